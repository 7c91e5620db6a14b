"""Paged varlen prefill (flash-attention style): every chunk reads all of its keys, cached context and
its own tokens alike, from the paged cache (the store kernel has already written this step's k/v).

    grid (query tile, kv_head, sequence)      programs past a sequence's chunk return at once

    rows of one program = BLOCK_Q queries x GROUP query heads of one KV head (GQA folded into rows),
    so each K/V tile gathered through the block table serves the whole group:

        row r -> query q0 + r // GROUP, head kv_head * GROUP + r % GROUP

    keys of a tile whose queries sit at positions ctx+q0 .. ctx+q_last:

        0 ......... lo ............ ctx+q0 ....... ctx+q_last
                    [ full tiles    )[ diagonal tiles ]
        lo: first tile a window can reach (0 without a window)
        full tiles: every row sees every key (no causal mask, only the window's)
        diagonal tiles: causal mask kpos <= qpos, reads masked past the last query

Bidirectional spans (Gemma 3's images, a diffusion model's canvas): each query row may carry the last
key it sees (`query_limits`, >= its own position: a span's end - 1 inside a span); the causal bound
becomes kpos <= limit, the full tiles stop at the tile's smallest limit and the diagonal ones at its
largest (every such key is written: a chunk holds the rest of any span it enters). A window still
counts back from the query's own position.

A short chunk after a context (draft verification: 1..k+1 tokens) is the same thing with few rows, so
BLOCK_M shrinks with the longest chunk of the step (a host int) to waste fewer padding rows.

Attention sinks (gpt-oss: per head one more logit, of a zero value) start each row's running max at its
head's sink and its sum at 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foveal.attention.kernels.tile import (
    LOG2E_C,
    NEG_INIT,
    dot_args,
    load_kv,
    pool_args,
    scales,
    softmax_step,
)

MAX_BLOCK_M = 128


@triton.jit
def _tile(
    q,
    k_base,
    s_base,
    stride_kv,
    table,
    n0,
    hi,
    qpos,
    qlim,
    window,
    d,
    d_ok,
    m_i,
    l_i,
    acc,
    qk_scale,
    cap_in,
    cap_out,
    stride_slot,
    stride_skv,
    stride_sslot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pos = n0 + tl.arange(0, BLOCK_N)
    if CAUSAL:
        pos_ok = pos < hi  # the table may end inside this tile
    else:
        pos_ok = pos >= 0
    k, v = load_kv(
        k_base, s_base, table, pos, pos_ok, d, d_ok, q, stride_kv, stride_slot, stride_skv, stride_sslot,
        BLOCK_SIZE, GROUP_SIZE, QUANT, not (EVEN_D and not CAUSAL),
    )  # fmt: skip
    if CAUSAL:
        allowed = pos[None, :] <= qlim[:, None]
    else:
        allowed = pos_ok[None, :]
    if USE_WINDOW:
        allowed = allowed & (pos[None, :] > qpos[:, None] - window)
    return softmax_step(
        q, k, v, allowed, m_i, l_i, acc, qk_scale, cap_in, cap_out, USE_SOFTCAP, DOT_PREC, UPCAST
    )


@triton.jit(do_not_specialize=["stride_table"])  # the table width varies step to step
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,
    tables_ptr,
    cu_q_ptr,
    ctx_ptr,
    lim_ptr,
    out_ptr,
    sinks_ptr,
    qk_scale,
    cap_in,
    cap_out,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv,
    stride_slot,
    stride_ch,
    stride_table,
    stride_skv,
    stride_sslot,
    stride_sh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_LIMIT: tl.constexpr,
    USE_SINKS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    # the last query tiles see the most keys: start them first
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    q0 = tile * BLOCK_Q
    if q0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    qi = q0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (qi < q_len)
    row_mask = row_ok[:, None] & d_ok[None, :]
    rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask)
    qpos = ctx + qi

    q_first = ctx + q0
    if USE_LIMIT:  # the last key each row sees (>= its position)
        qlim = tl.load(lim_ptr + rows, mask=row_ok, other=0)
        hi = tl.max(tl.where(row_ok, qlim, 0), axis=0) + 1
        seen_by_all = tl.min(tl.where(row_ok, qlim, 2147483647), axis=0)
    else:
        qlim = qpos
        hi = ctx + tl.minimum(q0 + BLOCK_Q, q_len)  # one past the tile's last query position
        seen_by_all = q_first
    if USE_WINDOW:
        lo = tl.maximum(q_first - window + 1, 0) // BLOCK_N * BLOCK_N
    else:
        lo = q_first * 0
    full_end = tl.maximum(lo, (seen_by_all + 1) // BLOCK_N * BLOCK_N)  # keys every row of the tile sees

    m_i = tl.full([BLOCK_M], NEG_INIT, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if USE_SINKS:  # the sink's logit (log2 domain), and exp2(0) = 1 in the sum
        sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * LOG2E_C
        m_i = tl.where(row_ok, sink, m_i)
        l_i = tl.where(row_ok, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    s_base = scale_ptr + kvh * stride_sh
    table = tables_ptr + seq * stride_table
    EVEN_D: tl.constexpr = HEAD_DIM == HEAD_PAD
    for n0 in range(lo, full_end, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, k_base, s_base, stride_kv, table, n0, hi, qpos, qlim, window, d, d_ok, m_i, l_i, acc,
            qk_scale, cap_in, cap_out, stride_slot, stride_skv, stride_sslot, BLOCK_SIZE, BLOCK_N, EVEN_D,
            False, GROUP_SIZE, QUANT, USE_WINDOW, USE_SOFTCAP, DOT_PREC, UPCAST,
        )  # fmt: skip
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _tile(
            q, k_base, s_base, stride_kv, table, n0, hi, qpos, qlim, window, d, d_ok, m_i, l_i, acc,
            qk_scale, cap_in, cap_out, stride_slot, stride_skv, stride_sslot, BLOCK_SIZE, BLOCK_N, EVEN_D,
            True, GROUP_SIZE, QUANT, USE_WINDOW, USE_SOFTCAP, DOT_PREC, UPCAST,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def block_m_for(max_q_len: int, group: int) -> int:
    """Rows per program: enough for the longest chunk's queries x group, 16..128 (tl.dot's minimum up
    to the register budget), at least one whole group."""
    rows = triton.next_power_of_2(max(1, max_q_len) * group)
    return max(min(max(rows, 16), MAX_BLOCK_M), triton.next_power_of_2(group))


def launch_config(block_m: int, head_pad: int, elem_bytes: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). On an H200 (bf16, head_dim 128, 32 heads / 8 KV heads; 2026-11,
    one sweep) 128 x 128 tiles with 8 warps and 3 pipeline stages ran ~5% faster than 128 x 64 with 2
    (338 vs 318 TFLOP/s on a 4096 prompt); their 3 x 64 KiB of K/V tiles fit shared memory only for
    16-bit K/V and head_dim <= 128 (the only shape measured), so other shapes keep the smaller tiles."""
    if block_m >= 128 and elem_bytes == 2 and head_pad <= 128:
        return 128, 8, 3
    return 64, 8 if block_m * head_pad >= 128 * 128 else 4, 2


def paged_prefill(
    q: torch.Tensor,  # [Tp, H, hd], the prefill rows only
    kv_cache: torch.Tensor,  # [2, slots, kv_heads, hd], this step's k/v already stored
    block_table: torch.Tensor,  # [P, max_blocks] int32
    cu_q_lens: torch.Tensor,  # [P + 1] int32, offsets of each chunk in q
    context_lens: torch.Tensor,  # [P] int32, tokens cached before each chunk
    out: torch.Tensor,  # [Tp, H, hd], written
    scale: float,
    *,
    block_size: int,
    max_q_len: int,
    window: int | None = None,
    softcap: float | None = None,
    query_limits: torch.Tensor | None = None,  # [Tp] int32: the last key position each row sees
    sinks: torch.Tensor | None = None,  # [H] attention-sink logits, or None
    kv_scale: torch.Tensor | None = None,  # a quantized pool's scales (kv_cache then holds its codes)
) -> torch.Tensor:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[2]
    group = num_heads // num_kv
    num_seqs = context_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    assert out.stride(2) == 1 and kv_cache.stride(3) == 1
    block_m = block_m_for(max_q_len, group)
    block_q = block_m // group
    head_pad = triton.next_power_of_2(head_dim)
    qk_scale, cap_in, cap_out = scales(scale, softcap)
    block_n, num_warps, num_stages = launch_config(block_m, head_pad, kv_cache.element_size())
    grid = (triton.cdiv(max_q_len, block_q), num_kv, num_seqs)
    scale_t, scale_strides, quant = pool_args(kv_cache, kv_scale)
    _prefill_kernel[grid](
        q,
        kv_cache,
        scale_t,
        block_table,
        cu_q_lens,
        context_lens,
        cu_q_lens if query_limits is None else query_limits,  # unread without limits
        out,
        q if sinks is None else sinks,  # unread without sinks
        qk_scale,
        cap_in,
        cap_out,
        window or 0,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        block_table.stride(0),
        *scale_strides,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        USE_LIMIT=query_limits is not None,
        USE_SINKS=sinks is not None,
        **quant,
        **dot_args(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
