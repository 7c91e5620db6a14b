"""The attention-backend protocol. A backend owns how K/V are written into the paged cache and how
attention reads them; models only call `forward`. `plan` runs once per step, `forward` once per layer.

Token order within a step (set by the runner): all decode rows (one query token each) first, then
prefill chunks, each a contiguous run of tokens of one sequence.

Masks beyond causal: a layer may pass a sliding `window` (a query at position p sees keys in
(p - window, p]) and a step may name per-sequence bidirectional spans (an image's tokens see each
other both ways, Gemma 3). They combine as transformers' Gemma 3 does:

    attend(q, k) = (k <= q  or  q and k in one span)  and  (k > q - window, when the layer has one)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionBatch:
    """What the runner tells a backend about one step (plain data; the backend builds its metadata)."""

    query_lens: list[int]  # new tokens per sequence this step
    context_lens: list[int]  # tokens of each sequence already in the cache before this step
    block_tables: list[Sequence[int]]  # per sequence, the physical blocks holding its tokens in order
    num_decodes: int  # the first num_decodes sequences have query_len == 1
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token (block * block_size + offset)
    block_size: int
    # per sequence, absolute [start, end) position ranges whose tokens attend to each other both ways
    # (None: no spans). A chunk must hold the rest of any span it enters (the scheduler's atomic spans):
    # keys past the chunk are not written yet.
    bidirectional: list[list[tuple[int, int]]] | None = None


def graph_slots(batch: AttentionBatch) -> torch.Tensor:
    """The slots of a decode-only batch for graph metadata: `slot_mapping` as given (rows that write
    elsewhere than their context position: a DFlash block; the engine gives a host tensor, a device one
    is read back), else each row's token at position ctx goes to table[ctx // bs] * bs + ctx % bs."""
    sm = batch.slot_mapping
    if sm is not None:
        return sm.cpu()
    bs = batch.block_size
    return torch.tensor([t[c // bs] * bs + c % bs for c, t in zip(batch.context_lens, batch.block_tables)])


class AttentionBackend(Protocol):
    name: str

    def plan(self, batch: AttentionBatch, device: torch.device) -> Any: ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        kv_cache: Any,  # [2, num_slots, num_kv_heads, head_dim] tensor, or kv_quant.QuantizedKVCache
        meta: Any,
        scale: float,
        *,
        window: int | None = None,  # sliding window of this layer (None: full attention)
        softcap: float | None = None,  # scores become softcap * tanh(scores / softcap) before the mask
    ) -> torch.Tensor: ...  # [T, num_heads, head_dim]
