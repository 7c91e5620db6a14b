"""LLaVA-1.5: a CLIP vision tower (transformers' module, run once per image), a two-layer MLP
projector (ours) and a native Llama-family decoder on the paged KV cache.

Every image is resized to one fixed size by the processor, so images of any requests stack into one
encoder batch. The features come from `vision_feature_layer` (a hidden-state index, or a list whose
states are concatenated); strategy "default" drops the CLS token, "full" keeps it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foveal.models.vlm import LLAVA_STYLE_PREFIXES, ImageAdapter, VisionLanguageModel, hf_module

_ACTS = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class LlavaProjector(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, bias: bool, act: str):
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"projector activation {act!r} is not supported ({', '.join(_ACTS)})")
        self.linear_1 = nn.Linear(in_dim, out_dim, bias=bias)
        self.linear_2 = nn.Linear(out_dim, out_dim, bias=bias)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def projector_for(config) -> LlavaProjector:
    """The projector of a LLaVA-style config: the tower's width x its feature layers -> the decoder's."""
    layers = config.vision_feature_layer
    n_layers = 1 if isinstance(layers, int) else len(layers)
    return LlavaProjector(
        config.vision_config.hidden_size * n_layers,
        config.text_config.hidden_size,
        bool(getattr(config, "multimodal_projector_bias", True)),
        config.projector_hidden_act,
    )


def tower_features(model, pixels: torch.Tensor) -> torch.Tensor:
    """`model`'s vision tower on `pixels`, the config's feature layers concatenated (less the CLS token
    with strategy "default"), projected: [images, tokens, hidden] in the decoder's width."""
    cfg = model.config
    w = model.multi_modal_projector.linear_1.weight
    pixels = pixels.to(device=w.device, dtype=w.dtype)
    out = model.vision_tower(pixels, output_hidden_states=True, return_dict=True)
    layers = cfg.vision_feature_layer
    states = [out.hidden_states[i] for i in ([layers] if isinstance(layers, int) else layers)]
    if cfg.vision_feature_select_strategy == "default":
        states = [h[:, 1:] for h in states]
    return model.multi_modal_projector(torch.cat(states, dim=-1))


class LlavaAdapter(ImageAdapter):
    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        pv = out["pixel_values"]
        cfg = self.config
        patch = cfg.vision_config.patch_size
        n = (pv.shape[-2] // patch) * (pv.shape[-1] // patch)
        if cfg.vision_feature_select_strategy == "full":
            n += 1
        return [({"pixel_values": pv[i : i + 1]}, n) for i in range(pv.shape[0])]


class LlavaForConditionalGeneration(VisionLanguageModel):
    mm_adapter = LlavaAdapter
    PREFIXES = LLAVA_STYLE_PREFIXES

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.multi_modal_projector = projector_for(config)
        self.vision_tower: nn.Module | None = None

    def build_vision(self, device, dtype) -> None:
        from transformers import AutoModel

        self.vision_tower = hf_module(lambda: AutoModel.from_config(self.config.vision_config), device, dtype)

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        return list(tower_features(self, torch.cat([it["pixel_values"] for it in items])))
