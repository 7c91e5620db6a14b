"""Attention for transformers' Qwen-VL vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and its MoE): every
segment of a layer (a frame group in the full-attention layers, a window in Qwen2.5-VL's others) in one
call, where the towers' default path ("sdpa") makes one attention call per segment.

A 30 s clip at 2 fps has 30 frame groups of ~1,200 patches, so ~600 windows of <= 64: ~17,000 calls a
tower pass for Qwen2.5-VL-7B, which took 1.35 s on an H100 for a pass whose arithmetic is ~0.1 s (the
host launching small kernels). Here the segments of a layer are laid out as a padded batch [S, H, L, D]
(one index map per layout, cached by the segment lengths), one scaled_dot_product_attention call with a
key-padding mask (none when the segments are equal, as a video's frame groups are), and scattered back.

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
def _layout(cu: tuple[int, ...], device: str):
    """(positions of the packed rows in the padded [S * L] rows or None when the segments are equal,
    key mask [S, 1, 1, L] or None, S, L) for segment boundaries `cu`."""
    lens = torch.tensor([b - a for a, b in zip(cu, cu[1:])])
    S, L = len(lens), int(lens.max())
    if int(lens.min()) == L:
        return None, None, S, L
    start = torch.tensor(cu[:-1]).repeat_interleave(lens)
    flat = torch.arange(S).repeat_interleave(lens) * L + torch.arange(cu[-1]) - start
    keep = torch.zeros(S * L, dtype=torch.bool)
    keep[flat] = True
    return flat.to(device), keep.view(S, 1, 1, L).to(device), S, L


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
    flat, mask, S, L = _layout(cu, str(query.device))

    def padded(t: torch.Tensor) -> torch.Tensor:  # [1, H, N, D] -> [S, H, L, D]
        rows = t[0].transpose(0, 1)  # [N, H, D]
        if flat is not None:
            rows = rows.new_zeros(S * L, H, D).index_copy_(0, flat, rows)
        return rows.reshape(S, L, H, D).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        padded(query), padded(key), padded(value), attn_mask=mask, dropout_p=dropout, scale=scaling
    )
    out = out.transpose(1, 2).reshape(S * L, H, D)
    if flat is not None:
        out = out.index_select(0, flat)
    return out.unsqueeze(0), None
