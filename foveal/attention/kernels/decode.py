"""Paged decode: one query token per sequence, all query heads of a KV group at once, keys split across
programs (flash-decoding) and merged by a second small kernel.

    grid (seq, kv_head, split)          keys of one sequence, split into num_splits tile-aligned ranges
                                        (sized from its own length, so short sequences finish early)
      split 0         split 1         split 2
    [ tile | tile ] [ tile | tile ] [ tile | .. ]   tile = BLOCK_N positions, gathered slot by slot
                                                     through the block table (any block_size)
    q [GROUP_PAD, D] @ k^T [D, BLOCK_N]  ->  scores [GROUP_PAD, BLOCK_N]
        the GROUP query heads of the KV head are the rows, padded to >= 16 for tl.dot (padding rows
        load zeros and are never stored), so each K/V tile is read once per KV head, not per query head

    each split writes (max, sum, acc) partials; the combine kernel (grid (seq, head)) rescales them by
    exp2(max_s - max) and divides by the rescaled sum. With one split the first kernel writes out directly.

num_splits is a host int chosen without device data (from lengths known at plan time, or a bound on them
for CUDA graphs), passed as a runtime argument so that one compiled kernel serves every count. A
sequence of length 0 (a graph padding row) has empty splits everywhere and writes 0. A sliding window
starts the key range at the tile holding position seq_len - window. Attention sinks (gpt-oss: per
head one more logit, of a zero value) start split 0's running max at the sink and its sum at 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foveal.attention.kernels.shared_prefix import SharedPrefixes, shared_prefix_attention
from foveal.attention.kernels.tile import (
    LOG2E_C,
    NEG_INIT,
    dot_args,
    load_kv,
    pool_args,
    scales,
    softmax_step,
)
from foveal.layers import pdl
from foveal.layers.pdl import begin

BLOCK_N = 64  # keys per tile; bf16 head_dim 128: a 16 KiB K tile and the same for V
NUM_WARPS = 4
NUM_STAGES = 2


# What varies step to step is not specialized on: the split counts and the table's width, and where the
# lengths and tables sit (an eager step's packed metadata is 16-byte aligned, a graph's static rows are
# not; specialized, an eager step compiled variants of its own at its first use, mid-traffic)
@triton.jit(
    do_not_specialize=["num_splits", "num_slots", "stride_table", "stride_len"],
    do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "prefix_lens_ptr"],
)
def _decode_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    sinks_ptr,
    prefix_lens_ptr,
    qk_scale,
    cap_in,
    cap_out,
    window,
    num_splits,  # a runtime int: one compiled kernel serves every split count
    num_slots,  # partial slots a row: num_splits, one more with shared prefixes
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_slot,
    stride_ch,
    stride_table,
    stride_len,
    stride_skv,
    stride_sslot,
    stride_sh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the output, no partials
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    SHARED: tl.constexpr,  # rows may start past a shared prefix (shared_prefix.py attends to it)
    GROUP_SIZE: tl.constexpr,  # channels per scale of a quantized pool
    QUANT: tl.constexpr,  # the pool holds fp8 / int8 codes and scale_ptr their scales
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq * stride_len)
    if USE_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    else:
        lo = seq_len * 0
    if SHARED:
        skip = tl.load(prefix_lens_ptr + seq)  # keys [0, skip) are the shared-prefix kernel's
        lo = tl.maximum(lo, skip)
    lo = lo // BLOCK_N * BLOCK_N
    # tile-aligned split ranges sized from this sequence's own length
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_PAD)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    row_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask, other=0.0)

    m_i = tl.full([GROUP_PAD], NEG_INIT, tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if USE_SINKS:  # the sink's logit (log2 domain) and its exp2(0) = 1, counted by split 0 only
        sink = tl.load(sinks_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * LOG2E_C
        first = g_ok & (split == 0)
        m_i = tl.where(first, sink, m_i)
        l_i = tl.where(first, 1.0, l_i)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    s_base = scale_ptr + kvh * stride_sh
    table = tables_ptr + seq * stride_table
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k, v = load_kv(
            k_base, s_base, table, pos, pos_ok, d, d_ok, q, stride_kv, stride_slot, stride_skv, stride_sslot,
            BLOCK_SIZE, GROUP_SIZE, QUANT,
        )  # fmt: skip
        allowed = pos_ok
        if USE_WINDOW:
            allowed = allowed & (pos >= seq_len - window)
        if SHARED:
            allowed = allowed & (pos >= skip)
        m_i, l_i, acc = softmax_step(
            q, k, v, allowed[None, :], m_i, l_i, acc, qk_scale, cap_in, cap_out, USE_SOFTCAP, DOT_PREC, UPCAST
        )

    if DIRECT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # length 0 (padding row): zeros
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # partial rows are (seq, head, slot), contiguous; a shared-prefix row's last slot is the prefix's
        row = (seq * tl.num_programs(1) * GROUP + heads) * num_slots + split
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "num_slots"], do_not_specialize_on_alignment=["prefix_lens_ptr"])
def _combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    prefix_lens_ptr,
    out_ptr,
    num_splits,
    num_slots,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    d = tl.arange(0, HEAD_PAD)
    if SHARED:  # the prefix's slot too, where this row has one
        s_ok = s < num_splits + (tl.load(prefix_lens_ptr + seq) > 0).to(tl.int32)
    else:
        s_ok = s < num_splits
    d_ok = d < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_slots + s
    m = tl.load(part_ml_ptr + row * 2, mask=s_ok, other=NEG_INIT)
    sums = tl.load(part_ml_ptr + row * 2 + 1, mask=s_ok, other=0.0)
    # empty splits hold NEG_INIT: weight exp2(NEG_INIT - max) = 0 beside any real split
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w * sums, 0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + seq * stride_ot + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def workspace_numel(
    num_seqs: int, num_heads: int, head_dim: int, num_splits: int, shared: bool = False
) -> int:
    """fp32 elements of the split partials (0 with one split and no shared prefixes)."""
    slots = num_splits + int(shared)
    return 0 if slots == 1 else num_seqs * num_heads * slots * (head_dim + 2)


def paged_decode(
    q: torch.Tensor,  # [D, H, hd]
    kv_cache: torch.Tensor,  # [2, slots, kv_heads, hd]
    block_table: torch.Tensor,  # [D, max_blocks] int32 (any row stride)
    seq_lens: torch.Tensor,  # [D] int32, including the token just stored; 0: padding row
    out: torch.Tensor,  # [D, H, hd], written
    scale: float,
    *,
    block_size: int,
    num_splits: int,
    window: int | None = None,
    softcap: float | None = None,
    workspace: torch.Tensor | None = None,  # fp32, >= workspace_numel(...) elements
    sinks: torch.Tensor | None = None,  # [H] attention-sink logits, or None
    shared: SharedPrefixes | None = None,  # rows' shared prefixes, attended once per tile of rows
    kv_scale: torch.Tensor | None = None,  # a quantized pool's scales (kv_cache then holds its codes)
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv = kv_cache.shape[2]
    group = num_heads // num_kv
    if num_seqs == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    assert out.stride(2) == 1 and kv_cache.stride(3) == 1
    shared = shared if shared is not None and shared.num_tiles else None
    slots = num_splits + int(shared is not None)
    n = workspace_numel(num_seqs, num_heads, head_dim, num_splits, shared is not None)
    if n and (workspace is None or workspace.numel() < n):
        workspace = torch.empty(n, dtype=torch.float32, device=q.device)
    part_acc = part_ml = workspace
    if n:
        rows = num_seqs * num_heads * slots
        part_acc, part_ml = workspace[: rows * head_dim], workspace[rows * head_dim : n]
    qk_scale, cap_in, cap_out = scales(scale, softcap)
    head_pad = triton.next_power_of_2(head_dim)
    scale_t, scale_strides, quant = pool_args(kv_cache, kv_scale)
    _decode_kernel[(num_seqs, num_kv, num_splits)](
        q,
        kv_cache,
        scale_t,
        block_table,
        seq_lens,
        out,
        part_acc,
        part_ml,
        q if sinks is None else sinks,
        seq_lens if shared is None else shared.prefix_lens,
        qk_scale,
        cap_in,
        cap_out,
        window or 0,
        num_splits,
        slots,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        seq_lens.stride(0),
        *scale_strides,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows on GPU
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_N=BLOCK_N,
        DIRECT=slots == 1,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_SINKS=sinks is not None,
        SHARED=shared is not None,
        **quant,
        **dot_args(q.dtype),
        **pdl.launch_args(q),
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if shared is not None:
        shared_prefix_attention(
            q, kv_cache, block_table, shared, part_acc, part_ml, slots, scale, softcap, block_size, kv_scale
        )
    if slots > 1:
        _combine_kernel[(num_seqs, num_heads)](
            part_acc,
            part_ml,
            seq_lens if shared is None else shared.prefix_lens,
            out,
            num_splits,
            slots,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SPLIT_PAD=triton.next_power_of_2(slots),
            SHARED=shared is not None,
            **pdl.launch_args(q),
        )
    return out
