"""The contract between the runner and a model: one `StepContext` per forward pass, and the class
attributes a runner reads (declared here with their defaults, so nobody probes with getattr).

    hidden = model(input_ids, ctx)          # [T, hidden] for the T fed tokens of the step
    logits = model.compute_logits(hidden)   # of the rows the runner picked

A vision-language model also implements `encode_images(items) -> [embeddings per image]`
(`is_multimodal`); the runner scatters those embeddings into `ctx.inputs_embeds`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from foveal.lora.stacks import LoRABatch


@dataclass(slots=True)
class StepContext:
    """Everything one forward pass needs besides the token ids."""

    positions: torch.Tensor  # [T] token positions; [3, T] for M-RoPE models (`uses_mrope`)
    kv_caches: list[Any]  # one per decoder layer
    attn: Any  # the attention backend's metadata for this step (`backend.plan(...)`)
    inputs_embeds: torch.Tensor | None = None  # [T, hidden]: replaces the embedding lookup (image rows)
    # DeepStack (Qwen3-VL): (rows [R], values [R, k, hidden]); values[:, i] is added to those rows'
    # hidden states after decoder layer i
    deepstack: tuple[torch.Tensor, torch.Tensor] | None = None
    # hidden-state drafters (foveal/speculative/hidden.py): the model appends the hidden state entering
    # each of these decoder layers (HF's hidden_states[i]; i = num_layers: the last layer's output before the
    # final norm) to `aux`, in layer order
    aux_layers: tuple[int, ...] = ()
    aux: list[torch.Tensor] | None = None
    # LoRA adapters (foveal/lora/stacks.py LoRABatch): the step's rows grouped by adapter slot, which
    # the model passes to every LoRA-capable linear (`Linear.forward(x, lora)`); None: no adapter row
    lora: LoRABatch | None = None


class CausalLM(nn.Module):
    """Base of every model the runner drives."""

    uses_mrope = False  # positions are [3, T] (Qwen2-VL family); decodes pass [T] (every axis alike)
    mm_bidirectional = False  # an image's tokens attend to each other both ways (Gemma 3)
    deepstack_layers = 0  # image embeddings carry this many more hidden-sized vectors per row
    is_multimodal = False  # implements encode_images
    supports_aux_hidden = False  # fills StepContext.aux (EAGLE-3, DFlash drafters read it)
    default_pooling: str | None = None  # an embedding model's pooling ("last", "mean"); None: generative

    def forward(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    # -- rotary positions where they are not the token's index (`uses_mrope`) ------------------------
    def rope_positions(self, spans: list[tuple[int, int, Any]]) -> torch.Tensor:
        """[3, T] positions of a step's fed tokens: per item (start, end, rope), `rope` being the
        request's `MultiModalPrompt.rope` (the family's own data; None for a text-only prompt)."""
        raise NotImplementedError

    def position_shift(self, rope: Any) -> int:
        """How far a request's generated tokens sit past their index, on every axis: a decode row's
        1-D position is index + this (0 unless the family's positions say otherwise)."""
        return 0
