"""Gemma 3 (vision): a SigLIP vision tower (transformers' module, run once per image), a projector
(ours) and the native Gemma 3 text decoder (gemma3_text.py) on the paged KV cache.

Every image is resized to the tower's fixed size, so images of any requests stack into one encoder
batch. The projector average-pools the patch grid down to `mm_tokens_per_image` tokens, RMS-norms
them (Gemma style, 1 + w) and multiplies by a [vision_hidden, text_hidden] matrix.

The processor expands each image marker (`boi_token`) into

    \\n\\n <start_of_image> <image_soft_token> x mm_tokens_per_image <end_of_image> \\n\\n

and only the soft tokens take image embeddings. An image's soft tokens attend to each other both ways
(`mm_bidirectional`: the runner passes the spans to the attention backend, and the scheduler keeps a
span inside one prefill chunk), on sliding and full layers alike.

Pan-and-scan crops are not supported (the processor default leaves it off): each image is one item.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foveal.models.base import StepContext
from foveal.models.gemma3_text import Gemma3ForCausalLM, GemmaRMSNorm
from foveal.models.vlm import LLAVA_STYLE_PREFIXES, ImageAdapter, VisionLanguageModel, hf_module


class Gemma3Projector(nn.Module):
    def __init__(self, config):
        super().__init__()
        vision, text = config.vision_config, config.get_text_config()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vision.hidden_size, text.hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)
        self.side = vision.image_size // vision.patch_size  # patches per side
        tokens_side = int(round(config.mm_tokens_per_image**0.5))
        if tokens_side**2 != config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(
                f"mm_tokens_per_image {config.mm_tokens_per_image} must be a square whose side divides "
                f"the {self.side}x{self.side} patch grid"
            )
        self.kernel = self.side // tokens_side

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B, side * side, vision_hidden] -> [B, mm_tokens_per_image, text_hidden]"""
        b, _, c = patches.shape
        grid = patches.transpose(1, 2).reshape(b, c, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).to(patches.dtype)


class Gemma3Adapter(ImageAdapter):
    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        crops = out.get("num_crops")
        if crops is not None and any(int(c) for c in torch.as_tensor(crops).flatten()):
            raise ValueError("Gemma 3 pan-and-scan crops are not supported; set do_pan_and_scan=False")
        pv = out["pixel_values"]
        n = int(self.config.mm_tokens_per_image)
        return [({"pixel_values": pv[i : i + 1]}, n) for i in range(pv.shape[0])]


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    mm_adapter = Gemma3Adapter
    mm_bidirectional = True
    implements_sliding_window = True
    PREFIXES = LLAVA_STYLE_PREFIXES

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.multi_modal_projector = Gemma3Projector(config)
        self.vision_tower: nn.Module | None = None
        tid = getattr(config, "image_token_id", None)
        self.image_token_id = int(tid if tid is not None else config.image_token_index)

    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        return Gemma3ForCausalLM(text_config, backend, max_positions)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        # the image token may lie past the text vocabulary; its rows are overwritten by image embeddings
        if self.image_token_id >= self.language_model.spec.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        return self.language_model.embed_input_ids(input_ids)

    def forward(self, input_ids, ctx: StepContext) -> torch.Tensor:
        if ctx.inputs_embeds is None:  # the image token id may lie past the text vocabulary
            ctx = replace(ctx, inputs_embeds=self.embed_input_ids(input_ids))
        return self.language_model(input_ids, ctx)

    def build_vision(self, device, dtype) -> None:
        from transformers import AutoModel

        self.vision_tower = hf_module(lambda: AutoModel.from_config(self.config.vision_config), device, dtype)

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        w = self.multi_modal_projector.mm_input_projection_weight
        pixels = torch.cat([it["pixel_values"] for it in items]).to(device=w.device, dtype=w.dtype)
        patches = self.vision_tower(pixel_values=pixels, return_dict=True).last_hidden_state
        return list(self.multi_modal_projector(patches))
