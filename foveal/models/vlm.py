"""What every vision-language model shares: a native text decoder on the paged KV cache, vision
modules that run once per image, checkpoint-name routing, and the request-side adapter that splits a
processor's output into per-image items.

A VLM model implements `encode_images(items) -> [embeddings per image]` (batched across requests by
the runner) and delegates the decoder pass to its `language_model`. The runner writes image
embeddings into the input embeddings at the image placeholder positions; the decoder never knows.

Checkpoint names differ between transformers 4.x-era files (`language_model.model.layers...`) and 5.x
files (`model.language_model.layers...`); `PREFIXES` maps both to our modules.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from foveal.models.base import CausalLM, StepContext
from foveal.models.weights import ParamFiller

# text decoders by transformers model_type (the text_config of a VLM has no `architectures`)
_TEXT_MODELS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def text_model_class(text_config):
    from foveal.models import llama

    name = _TEXT_MODELS.get(getattr(text_config, "model_type", None))
    if name is None:
        raise ValueError(
            f"text model type {text_config.model_type!r} inside this VLM is not supported "
            f"(supported: {', '.join(sorted(_TEXT_MODELS))})"
        )
    return getattr(llama, name)


def hf_module(factory, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """Build a transformers module for real on `device` (so its non-persistent buffers hold values),
    skipping random init: the checkpoint fills every weight right after."""
    from transformers.initialization import no_init_weights

    with torch.device(device), no_init_weights():
        module = factory()
    return module.to(dtype).eval()


def uniform_frames(
    total: int, video_fps: float, *, fps: float | None = None, num_frames: int | None = None, max_frames: int
) -> list[int]:
    """`num_frames` of a clip's `total` frames spread evenly over it, or `fps` frames a second of it
    (every frame when neither is given), capped by `max_frames` and by the clip's frames, at least one.

    transformers' rule (a video processor's `sample_frames`; from 5.18 `default_sample_indices_fn`):
    n = int(total / video_fps * fps), frame i is i*total//n. Exact in integers; the float form
    floor(arange(0, total, total/n)) that Qwen2-VL's sampler and 5.17's `sample_frames` use rounds some
    i*step just below an integer (one frame early), or its length up (one index too many, == total: past
    the clip). 5.17's `default_sample_indices_fn`, which no video processor calls, steps by int(total/n)."""
    if fps is not None and num_frames is not None:
        raise ValueError("pass fps or num_frames, not both")
    if num_frames is not None:
        n = num_frames
    elif fps is not None and video_fps > 0:
        n = int(total / video_fps * fps)
    else:
        n = total
    n = max(1, min(n, max_frames, total))
    return [i * total // n for i in range(n)]


class MediaInput(NamedTuple):
    """One video's or audio clip's encoder inputs, its number of embeddings, and (None: a run of
    placeholder tokens) the text that replaces its placeholder, the placeholders inside it."""

    data: dict[str, Any]
    num_embeds: int
    text: str | None = None


class ImageAdapter:
    """Request-side knowledge of a family (no weights; runs in the server's thread pool): how the HF
    processor's batched output splits into one item per image, and how many embeddings each image takes.
    M-RoPE families also compute the [3, L] prompt positions."""

    video_token_id: int | None = None  # set by the families that take video
    # (start, end) marker ids a video brings around each of its frames itself, so the chat template's
    # wrapper around its placeholder is dropped (Qwen3-VL); None: the template's wrapper stays
    video_wrapper: tuple[int, int] | None = None
    # the text a video's placeholder is in the rendered prompt where it is no token of the vocabulary
    # (SmolVLM2's "<video>", which its processor replaces); None: the video token's own text
    video_placeholder: str | None = None
    audio_token_id: int | None = None  # ... and audio

    def __init__(self, hf_config, video_config: dict | None = None):
        tid = getattr(hf_config, "image_token_id", None)
        if tid is None:
            tid = getattr(hf_config, "image_token_index", None)
        if tid is None:
            raise ValueError(f"{type(hf_config).__name__} names no image token id")
        self.image_token_id = int(tid)
        self.config = hf_config

    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        """Processor output for N images -> N (this image's tensors, its number of embeddings)."""
        raise NotImplementedError

    def processor_images(self, images: list) -> list:
        """The `images` argument the processor wants for one prompt (some want a nested list)."""
        return images

    def frame_indices(
        self,
        total_frames: int,
        video_fps: float,
        *,
        fps: float | None = None,
        num_frames: int | None = None,
        max_frames: int | None = None,
    ) -> list[int]:
        """Which of a clip's frames to decode (the family's sampling rule)."""
        raise ValueError(f"{type(self.config).__name__} does not take video inputs")

    def video_inputs(self, clip, processor) -> MediaInput:
        """A `VideoClip` -> its encoder tensors, its number of embeddings, and the text that stands for
        it in the prompt where the family interleaves text with the frames (Qwen3-VL's timestamps)."""
        raise ValueError(f"{type(self.config).__name__} does not take video inputs")

    def video_parts(self, media: MediaInput) -> list[MediaInput]:
        """A clip's encoder inputs as the items the engine encodes one by one (the scheduler's encoder
        budget spreads them over steps), in prompt order: the whole clip, unless the family's tower
        encodes parts of it independently."""
        return [media]

    def audio_inputs(self, clip, processor) -> MediaInput:
        """An `AudioClip` (through the model's processor, whose feature extractor it uses) -> (its
        encoder tensors plus "seconds", the clip's length, and its number of embeddings)."""
        raise ValueError(f"{type(self.config).__name__} does not take audio inputs")

    def rope(self, prompt_ids: list[int], items: list) -> Any:
        """The family's rotary positions for this prompt (`MultiModalPrompt.rope`), or None when they
        are the token indices."""
        return None


# vision_tower + multi_modal_projector + language_model: LLaVA's layout, shared by Gemma 3 (and others)
LLAVA_STYLE_PREFIXES = (
    (("model.language_model.", "language_model.model."), "text"),
    (("lm_head.", "language_model.lm_head."), "lm_head"),
    (("model.vision_tower.", "vision_tower."), "vision_tower"),
    (("model.multi_modal_projector.", "multi_modal_projector."), "multi_modal_projector"),
)

_LEVEL = "vision_model."


def _match_level(rest: str, target: str, own: dict[str, set[str]], model: nn.Module) -> str:
    """Checkpoints name CLIP/SigLIP towers `vision_tower.vision_model.*`, while transformers 5 builds
    some of them flat (and renames on load): add or drop that level to match the module we built."""
    names = own.get(target)
    if names is None:
        sub = getattr(model, target)
        names = own[target] = {n for n, _ in sub.named_parameters()} | {n for n, _ in sub.named_buffers()}
    if rest in names:
        return rest
    if rest.startswith(_LEVEL) and rest[len(_LEVEL) :] in names:
        return rest[len(_LEVEL) :]
    if _LEVEL + rest in names:
        return _LEVEL + rest
    return rest


class VisionLanguageModel(CausalLM):
    """Base of our VLMs. Subclasses set `image_token_id`, build their vision modules in `build_vision`
    and implement `encode_images`."""

    is_multimodal = True
    # (checkpoint prefixes) -> our submodule: "text" is the decoder, anything else a module attribute
    PREFIXES: tuple[tuple[tuple[str, ...], str], ...] = ()

    def __init__(self, config, backend, max_positions: int):
        super().__init__()
        self.config = config
        self.language_model = self.build_text_model(config.get_text_config(), backend, max_positions)

    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        """The native decoder; families whose decoder is special (M-RoPE, Gemma) override this."""
        return text_model_class(text_config)(text_config, backend, max_positions)

    # -- decoder delegation -----------------------------------------------------------------------
    @property
    def spec(self):
        return self.language_model.spec

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.language_model.kv_shape

    @property
    def supports_aux_hidden(self) -> bool:
        return self.language_model.supports_aux_hidden

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_input_ids(input_ids)

    def forward(self, input_ids, ctx: StepContext) -> torch.Tensor:
        return self.language_model(input_ids, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # -- vision ------------------------------------------------------------------------------------
    def build_vision(self, device: torch.device, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Processor outputs of several images (any requests) -> per image [num_embeds, hidden]."""
        raise NotImplementedError

    @property
    def vision_dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    def reset_buffers(self, device, dtype=None) -> None:
        self.language_model.reset_buffers(device)
        self.build_vision(device, dtype or self.vision_dtype)

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        filler = ParamFiller(self)
        own: dict[str, set[str]] = {}
        for name, tensor in weights:
            self.load_weight(filler, name, tensor, own)
        filler.check_complete()

    def load_weight(
        self, filler: ParamFiller, name: str, tensor: torch.Tensor, own: dict | None = None
    ) -> None:
        """One checkpoint tensor, routed by its prefix (`own` caches the towers' parameter names)."""
        for prefixes, target in self.PREFIXES:
            rest = next((name[len(p) :] for p in prefixes if name.startswith(p)), None)
            if rest is None:
                continue
            if target == "text":
                self.language_model.load_weight(filler, rest, tensor, prefix="language_model.")
            elif target == "lm_head":
                self.language_model.load_weight(filler, "lm_head." + rest, tensor, "language_model.")
            else:
                filler.put(
                    f"{target}.{_match_level(rest, target, {} if own is None else own, self)}", tensor, name
                )
            return
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
