"""Tiny random-weight VLMs for parity tests: real transformers config, model and processor classes,
a byte-level tokenizer with the family's special tokens, all saved to a folder that Foveal loads like
any HF checkpoint. Plus two drivers: ours (engine, paged cache, scheduler) and the reference
(transformers, one full forward pass per generated token: slow, but correct by definition).

Family builders: `BUILDERS` here plus the `BUILDERS` dict of every `tests/tiny_vlm_*.py` module
(name -> function(path) -> TinyVLM), so adding a family touches no shared file.
"""

from __future__ import annotations

import importlib
import pathlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from foveal.loader import processors

# a chat template in the common HF VLM style: image (video, audio) parts render as the processor's token
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}{{ IMAGE }}"
    "{% elif p['type'] == 'video' %}{{ VIDEO }}{% elif p['type'] == 'audio' %}{{ AUDIO }}"
    "{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass
class TinyVLM:
    path: str  # folder with config.json, model.safetensors, tokenizer and processor files
    hf: Any  # the transformers model (fp32, eval)
    processor: Any
    image_text: str  # what one image looks like in a prompt before processing (e.g. "<image>")


def byte_tokenizer(specials: list[str], image_token: str, video_token: str = "", audio_token: str = ""):
    """A byte-level BPE with no merges (256 tokens) plus special tokens: tiny, offline, lossless."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token=None
    )
    fast.add_special_tokens({"additional_special_tokens": list(specials)})
    template = CHAT_TEMPLATE.replace("{{ IMAGE }}", image_token).replace("{{ VIDEO }}", video_token)
    fast.chat_template = template.replace("{{ AUDIO }}", audio_token)
    return fast


def perturb(model) -> None:
    """Random init leaves norms at 1 and biases at 0: perturb them so those paths are tested too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias") or "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("mlp.gate.weight"):  # a MoE router: distinct scores, no tie in the top k
                p.normal_(0, 0.5)


def save(model, processor, path: str) -> None:
    model.config.architectures = [type(model).__name__]
    model.save_pretrained(path)
    processor.save_pretrained(path)


def text_config_kwargs(vocab_size: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )


def build_llava(path: str) -> TinyVLM:
    import transformers as tf

    tok = byte_tokenizer(["<image>"], "<image>")
    vision = tf.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=28, patch_size=7, projection_dim=32,
    )  # fmt: skip
    text = tf.LlamaConfig(**text_config_kwargs(len(tok)), tie_word_embeddings=False)
    cfg = tf.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(0)
    hf = tf.LlavaForConditionalGeneration(cfg).eval()
    perturb(hf)
    ip = image_processor_class("CLIPImageProcessor")(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    )
    proc = tf.LlavaProcessor(
        image_processor=ip, tokenizer=tok, patch_size=7, vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tok.chat_template,
    )  # fmt: skip
    save(hf, proc, path)
    return TinyVLM(path, hf, proc, "<image>")


def save_tiny_text_model(path: str, specials: list[str] = ()) -> str:
    """A tiny random text-only Llama folder with the byte tokenizer (no processor files), plus
    `specials` as special tokens."""
    import transformers as tf

    tok = byte_tokenizer(list(specials), "")
    torch.manual_seed(0)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**text_config_kwargs(len(tok)), **ids))  # EOS: the tokenizer's
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


BUILDERS = {"llava": build_llava}


def image_processor_class(name: str):
    """The image processor class the tiny builders use (its PIL backend without torchvision); the test
    is skipped where this transformers cannot process images at all (5.17 without torchvision)."""
    reason = processors.images_unsupported()
    if reason:
        pytest.skip(reason)
    return processors.image_processor_class(name)


def all_builders() -> dict:
    found = dict(BUILDERS)
    for f in sorted(pathlib.Path(__file__).parent.glob("tiny_vlm_*.py")):
        found.update(importlib.import_module(f"tests.{f.stem}").BUILDERS)
    return found


def build(family: str, path: str) -> TinyVLM:
    """The reference gets the processor as Foveal loads it from the folder: transformers may pick a
    different image-processor backend for a saved config than for the object the builder made (with
    torchvision < 0.27 a LANCZOS resize loads as the PIL backend), and the test is about the model."""
    from foveal.loader.processors import load_hf_processor

    tiny = all_builders()[family](path)
    tiny.processor = load_hf_processor(path)
    return tiny


def image(w: int, h: int, seed: int):
    """A deterministic RGB test picture (noise, so every pixel matters)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


# -- drivers -----------------------------------------------------------------------------------------
def hf_greedy(tiny: TinyVLM, text: str, images: list, steps: int):
    """Reference: prompt logits [L, V] and `steps` greedy tokens, each from a full forward pass."""
    kwargs = {"images": images} if images else {}
    inputs = tiny.processor(text=[text], return_tensors="pt", **kwargs)
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    tokens, step_logits = [], []
    with torch.no_grad():
        prompt_logits = None
        for _ in range(steps + 1):
            logits = tiny.hf(input_ids=ids, **inputs).logits[0]
            if prompt_logits is None:
                prompt_logits = logits
            else:
                step_logits.append(logits[-1])
            nxt = int(logits[-1].argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            for key in ("token_type_ids", "mm_token_type_ids"):  # per-token inputs grow with ids (0: text)
                if key in inputs:
                    inputs[key] = torch.cat([inputs[key], inputs[key].new_zeros(1, 1)], dim=1)
    return prompt_logits, tokens[:steps], step_logits[: steps - 1]


def hf_greedy_ids(hf, prompt_ids: list[int], inputs: dict, steps: int):
    """transformers on fixed token ids and media inputs: the prompt's logits [L, V] and `steps` greedy
    tokens, each from a full forward pass over the ids so far (no cache)."""
    ids, tokens, first = torch.tensor([prompt_ids]), [], None
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(input_ids=ids, **inputs).logits[0]
            first = logits if first is None else first
            tokens.append(int(logits[-1].argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return first, tokens


def foveal_greedy(llm, prompts: list, steps: int):
    """Drive an LLM's engine step by step (greedy, ignore_eos). Per request: prompt logits [L, V] (from
    all chunks), generated tokens, and the logits behind each generated token after the first."""
    from foveal.request import SamplingParams

    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    rids = [engine.add_request(llm.processor.request(p, params)) for p in prompts]
    prompt_rows: dict[str, list[torch.Tensor]] = {r: [] for r in rids}
    tokens: dict[str, list[int]] = {r: [] for r in rids}
    step_logits: dict[str, list[torch.Tensor]] = {r: [] for r in rids}
    sched, runner = engine.scheduler, engine.runner
    while sched.num_unfinished:
        batch = sched.schedule()
        logits = runner.compute_logits(batch, all_tokens=True)
        sampled, off = {}, 0
        for s in batch.items:
            rid = s.request_id
            rows = logits[off : off + s.num_tokens]
            off += s.num_tokens
            if s.start < len(runner._held[rid].req.prompt_token_ids):
                prompt_rows[rid].append(rows)
            elif s.num_logits:
                step_logits[rid].append(rows[-1])
            if s.num_logits:
                sampled[rid] = [int(rows[-1].argmax())]
                tokens[rid] += sampled[rid]
        sched.update(batch, sampled)
    engine.kv.check_integrity()
    assert engine.kv.num_used_blocks == 0
    return [(torch.cat(prompt_rows[r]), tokens[r], step_logits[r]) for r in rids]
