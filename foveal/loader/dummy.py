"""`--load-format dummy`: a model of a real shape from its config alone, with random weights, for
benchmarks that must not download (or store) gigabytes of weights.

    foveal serve --model benchmarks/configs/llama-3.1-8b.json --load-format dummy

The config is a config.json file, or a folder holding one. A folder's own tokenizer (and processor)
are used when it has them; otherwise a synthetic word-level tokenizer stands in: token i is spelled
`t<i>` (so "t17 t942" encodes to [17, 942] and decodes back), the config's special ids (eos, bos,
image placeholders) carry their usual spellings, and the chat template is a plain ChatML one. That is
enough for every engine and server path (chat, stop strings, detokenization); text it produces is
noise, as the weights are.

Weights: every parameter is drawn on the target device, N(0, 0.02) for matrices and 1 for norm
scales (a zero or constant weight would make matmuls unrepresentatively fast).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from foveal.loader.errors import ModelLoadError

log = logging.getLogger(__name__)

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}{{ image_marker }}{% elif p['type'] == 'video' %}{{ video_marker }}"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# config attribute -> the spelling of that special token (the families' usual ones)
_SPECIAL_IDS = {
    "eos_token_id": "<|endoftext|>",
    "bos_token_id": "<|begin_of_text|>",
    "pad_token_id": "<|pad|>",
    "image_token_id": "<|image_pad|>",
    "image_token_index": "<image>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}


def load_config(path: str):
    """A transformers config from a config.json file or a folder holding one."""
    from transformers import AutoConfig

    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = {k: v for k, v in json.load(f).items() if not k.startswith("_comment")}
        from foveal.loader.safetensors_loader import foreign_config

        kind, data = foreign_config(data) or (data.pop("model_type"), data)
        config = AutoConfig.for_model(kind, **data)
    except Exception as e:
        raise ModelLoadError(f"could not read a model config from {file}: {type(e).__name__}: {e}") from e
    if not getattr(config, "architectures", None):
        raise ModelLoadError(f"{file} names no architectures")
    return config


def _special_tokens(config) -> dict[int, str]:
    """id -> spelling for the special ids the config names (a list of eos ids gets numbered spellings)."""
    out: dict[int, str] = {}
    for cfg in (config, config.get_text_config()):
        for attr, spelling in _SPECIAL_IDS.items():
            v = getattr(cfg, attr, None)
            for n, i in enumerate([v] if isinstance(v, int) else list(v or [])):
                out.setdefault(int(i), spelling if n == 0 else f"{spelling[:-2]}_{n}|>")
    return out


def synthetic_tokenizer(config):
    """A word-level tokenizer over the config's whole vocabulary (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = config.get_text_config().vocab_size
    specials = _special_tokens(config)
    free = (i for i in range(vocab_size - 1, -1, -1) if i not in specials)
    for marker in ("<|im_start|>", "<|im_end|>"):  # the chat template's markers take the last plain ids
        if marker not in specials.values():
            specials[next(free)] = marker
    names = [specials.get(i, f"t{i}") for i in range(vocab_size)]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=names[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    eos = specials.get(_first_id(config, "eos_token_id"), "<|im_end|>")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        additional_special_tokens=sorted(set(specials.values()) - {eos}),
    )
    ids = [_first_id(config, a) for a in ("vision_start_token_id", "image_token_id", "vision_end_token_id")]
    if ids[1] is None:
        ids[1] = _first_id(config, "image_token_index")
    image = "".join(specials[i] for i in dict.fromkeys(ids) if i is not None)
    ids[1] = _first_id(config, "video_token_id")  # a family that takes video (Qwen2-VL's): its marker
    video = "".join(specials[i] for i in dict.fromkeys(ids) if i is not None) if ids[1] is not None else ""
    fast.chat_template = CHATML.replace("{{ image_marker }}", image).replace("{{ video_marker }}", video)
    return fast


def _first_id(config, attr: str) -> int | None:
    for cfg in (config, config.get_text_config()):
        v = getattr(cfg, attr, None)
        if isinstance(v, int):
            return v
        if v:
            return int(v[0])
    return None


@torch.no_grad()
def randomize_weights(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter in place on its device: N(0, 0.02), norm scales 1. FP8 experts
    (layers/moe.py FusedMoE: uint8 bytes of float8_e4m3fn, int32 bits of float32 scales): N(0, 1) in
    float8 (finite: e4m3's range is +-448) and scales of 0.02, so their weights are N(0, 0.02) too."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None or gen.device != p.device:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if p.dtype == torch.uint8:
            for rows in torch.split(p, max(1, 2**26 // max(1, p.shape[-1]))):  # float32 a chunk at a time
                values = torch.empty(rows.shape, device=p.device).normal_(0.0, 1.0, generator=gen)
                rows.copy_(values.to(torch.float8_e4m3fn).view(torch.uint8))
        elif p.dtype == torch.int32 and name.endswith("_scale_inv"):
            p.view(torch.float32).fill_(0.02)
        elif p.dim() == 1 and "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def dummy_processor(config, tokenizer) -> Any:
    """The family's transformers processor from its defaults, for a VLM config without processor files."""
    import transformers

    from foveal.loader.processors import image_only_processor_class, image_processor_class, images_unsupported

    model_type = config.model_type
    if reason := images_unsupported():
        raise ModelLoadError(f"--load-format dummy cannot build an image processor: {reason}")
    found = {
        "qwen2_vl": ("Qwen2VLProcessor", "Qwen2VLImageProcessor"),
        "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLImageProcessor"),
    }.get(model_type)
    if found is None:
        raise ModelLoadError(
            f"--load-format dummy cannot build a processor for {model_type!r}; give a folder with its "
            "processor files"
        )
    proc_cls, image_cls = getattr(transformers, found[0]), image_processor_class(found[1])
    kw = dict(image_processor=image_cls(), tokenizer=tokenizer)
    kw["chat_template"] = tokenizer.chat_template
    # image-only whether or not torchvision is there: a default video processor is one more part to
    # build (transformers >= 5.17 insists on it when torchvision is installed) and nothing here uses it
    return image_only_processor_class(proc_cls)(**kw)
