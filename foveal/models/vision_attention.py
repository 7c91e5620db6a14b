"""Segment-batched attention for the Qwen-VL vision towers (transformers' modules).

These towers attend within segments of the patch sequence that `cu_seqlens` delimits: whole images,
and in Qwen2.5-VL also windows of 8x8 patches. Without flash-attention, transformers runs one SDPA
call per segment, plus a host sync per layer to split the sequence: a 448x448 image in Qwen2.5-VL is
16 windows x 28 windowed layers = 448 calls, 64 such images 28,672, and on a GPU the tower becomes
launch-bound (measured on the H200: ~80 ms for one image, ~2.5 s for 64).

Here segments of equal length go through one batched SDPA call: a layer costs one call per distinct
segment length (usually 1-3), and the plan (which rows belong to which call) is computed once per
`cu_seqlens` tensor, i.e. once per tower pass for the windowed layers and once for the full ones.
The arithmetic per segment is the same as transformers' (same scale, no mask, fp32 rotary).
"""

from __future__ import annotations

import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

# the fused CUDA kernels put batch x heads on one grid axis: stay under its 65,535 limit
_MAX_BATCH_HEADS = 65535


def plan_segments(cu_seqlens: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """[(segment length L, row indices [n, L] of the n segments of that length)], on cu's device."""
    bounds = cu_seqlens.tolist()
    by_len: dict[int, list[int]] = {}
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            by_len.setdefault(hi - lo, []).append(lo)
    plan = []
    for length, starts in by_len.items():
        s = torch.tensor(starts, dtype=torch.long)
        rows = s[:, None] + torch.arange(length)[None, :]
        plan.append((length, rows.to(cu_seqlens.device)))
    return plan


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: list[tuple[int, torch.Tensor]], scale: float
) -> torch.Tensor:
    """Bidirectional attention within each segment. q, k, v: [S, heads, head_dim] -> [S, heads, head_dim]."""
    if len(plan) == 1 and plan[0][1].shape[0] == 1 and plan[0][0] == q.shape[0]:  # one segment: no gather
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
        )
        return o[0].transpose(0, 1)
    out = torch.empty_like(q)
    per_call = max(1, _MAX_BATCH_HEADS // q.shape[1])
    for _, all_rows in plan:
        for rows in all_rows.split(per_call):
            # [n, L, H, D] -> [n, H, L, D], contiguous: CUDA's fused SDPA kernels have faulted on
            # strided batched inputs (vLLM's Mllama fix, pytorch#112577)
            qs, ks, vs = (t[rows].transpose(1, 2).contiguous() for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)
            out[rows] = o.transpose(1, 2)
    return out


def _forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    position_embeddings = kwargs.get("position_embeddings", args[0] if args else None)
    s = hidden_states.shape[0]
    q, k, v = self.qkv(hidden_states).reshape(s, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    cos, sin = position_embeddings
    q, k = self._foveal_rotary(q, k, cos, sin)
    out = segment_attention(q, k, v, self._foveal_plans(cu_seqlens), self.scaling)
    return self.proj(out.reshape(s, -1))


def patch_vision_attention(tower: nn.Module) -> int:
    """Give every `*VisionAttention` module of `tower` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL layout: `qkv`,
    `proj`, `num_heads`, `scaling`, forward(hidden_states, cu_seqlens, position_embeddings)) the
    segment-batched forward. Returns how many modules were patched."""
    cache: dict[int, tuple[torch.Tensor, list]] = {}

    def plans(cu: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        hit = cache.get(id(cu))
        if hit is None or hit[0] is not cu:
            hit = cache[id(cu)] = (cu, plan_segments(cu))  # the tensor is kept: its id stays unique
        return hit[1]

    tower.register_forward_pre_hook(lambda *_: cache.clear())  # a new pass, new cu_seqlens
    n = 0
    for m in tower.modules():
        if not type(m).__name__.endswith("VisionAttention"):
            continue
        if not all(hasattr(m, a) for a in ("qkv", "proj", "num_heads", "scaling")):
            continue
        rotary = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb_vision", None)
        if rotary is None:
            continue
        m._foveal_rotary, m._foveal_plans = rotary, plans
        m.forward = types.MethodType(_forward, m)
        n += 1
    return n
