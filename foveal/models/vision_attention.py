"""Attention for transformers' Qwen-VL vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE): every
segment of a layer (a frame group in the full-attention layers, a window in Qwen2.5-VL's others) in one
call, where the towers' default path ("sdpa") makes one attention call per segment.

A 30 s clip at 2 fps has 30 frame groups of ~1,200 patches, so ~600 windows of <= 64: ~17,000 calls a
tower pass for Qwen2.5-VL-7B, which took 1.35 s on an H100 for a pass whose arithmetic is ~0.1 s (the
host launching small kernels). Here the segments of a layer are laid out as padded batches [S, H, L, D]
of similar lengths (index maps cached by the segment boundaries), one scaled_dot_product_attention call
a batch with a key-padding mask (none when its segments are equal, as a video's frame groups are), and
scattered back: one call a layer for a clip, a few where images of very different sizes meet.

The towers take this path for an attention implementation whose name contains "flash" (they then pass
the packed sequence with its cu_seqlens, as to a flash-attention varlen kernel; transformers'
`is_flash_attention_requested`), registered through the public `AttentionInterface`. The name is set on
the built tower's config, not passed at construction: transformers would look for the flash-attn package
for such a name there. Equal, to float rounding, to the per-segment path (tests/test_vision_attention.py).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

NAME = "foveal_segments_flash"  # "flash" routes the towers' packed (cu_seqlens) path here


def use_segment_attention(tower: torch.nn.Module) -> torch.nn.Module:
    """The tower's attention layers call `segment_attention` from now on. The tower's modules get a
    config of their own first (transformers builds them on the config it is given, which is the
    model's: anything else built from it keeps its attention)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, segment_attention)
    shared = tower.config
    own = copy.deepcopy(shared)
    own._attn_implementation = NAME
    for m in list(tower.modules()):
        if getattr(m, "config", None) is shared:
            m.config = own
    return tower


@functools.lru_cache(maxsize=16)
def _buckets(cu: tuple[int, ...], device: str) -> list[tuple]:
    """The segments at boundaries `cu` in padded batches: longest first, a batch taking the next
    segment while its padded size stays within twice its rows (so a huge image beside small ones does
    not pad them all to its size). Each: (packed rows, their places in the padded [G * L] rows, G, L,
    key mask [G, 1, 1, L] or None); rows None when the batch is the whole packed input in order."""
    lens = [b - a for a, b in zip(cu, cu[1:])]
    order = sorted(range(len(lens)), key=lambda i: -lens[i])  # stable: equal lengths stay in order
    out, i = [], 0
    while i < len(order):
        group, L = [order[i]], lens[order[i]]
        total, i = L, i + 1
        while i < len(order) and (len(group) + 1) * L <= 2 * (total + lens[order[i]]):
            group.append(order[i])
            total, i = total + lens[order[i]], i + 1
        if group == list(range(len(lens))) and total == len(group) * L:
            out.append((None, None, len(group), L, None))
            continue
        rows = torch.cat([torch.arange(cu[g], cu[g + 1]) for g in group])
        slot = torch.cat([j * L + torch.arange(lens[g]) for j, g in enumerate(group)])
        mask = None
        if total != len(group) * L:
            mask = torch.zeros(len(group) * L, dtype=torch.bool)
            mask[slot] = True
            mask = mask.view(len(group), 1, 1, L).to(device)
        out.append((rows.to(device), slot.to(device), len(group), L, mask))
    return out


def segment_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask=None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
):
    """query/key/value [1, H, N, D] packed, segments at cu_seq_lens_q -> ([1, N, H, D], None), each
    segment attending within itself only (bidirectional)."""
    _, H, N, D = query.shape
    cu = (0, N) if cu_seq_lens_q is None else tuple(cu_seq_lens_q.tolist())
    packed = [t[0].transpose(0, 1) for t in (query, key, value)]  # [N, H, D] each
    out = None
    for rows, slot, G, L, mask in _buckets(cu, str(query.device)):
        if rows is None:
            q, k, v = (t.reshape(G, L, H, D).transpose(1, 2) for t in packed)
        else:
            q, k, v = (
                t.new_zeros(G * L, H, D)
                .index_copy_(0, slot, t.index_select(0, rows))
                .view(G, L, H, D)
                .transpose(1, 2)
                for t in packed
            )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling)
        o = o.transpose(1, 2).reshape(G * L, H, D)
        if rows is None:
            return o.unsqueeze(0), None
        if out is None:
            out = packed[0].new_empty(N, H, D)
        out.index_copy_(0, rows, o.index_select(0, slot))
    return out.unsqueeze(0), None
