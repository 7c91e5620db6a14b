"""Pieces shared by the decode and prefill kernels: gathering a tile of keys through the block table
(dequantizing a quantized pool's codes), and one online-softmax step over it.

Scores live in the log2 domain (scale * log2(e) folded into one multiply) so the kernels use exp2. The
running max starts at a large finite negative rather than -inf: a row whose keys are all masked in a
tile (a GQA padding row, a window's first tile) then keeps p = exp2(-inf - finite) = 0, never
exp2(-inf + inf) = NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foveal.config import triton_interpreted

LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # for kernels
# running-max start and the max of an empty split (finite: see above); constexpr so kernels may read it
NEG_INIT = tl.constexpr(-1.0e30)


@triton.jit
def tanh(x):
    # exp-based (tl.math has no tanh in every Triton we support); exp2 of a non-positive argument
    # never overflows
    t = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    r = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -r, r)


@triton.jit
def slots_at(table_ptr, pos, pos_ok, BLOCK_SIZE: tl.constexpr):
    """The cache slots (int64) holding positions `pos` of the sequence whose block-table row starts at
    table_ptr; positions outside pos_ok read block 0 (in bounds, masked later)."""
    blk = tl.load(table_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0)
    return blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE


@triton.jit
def load_kv(
    k_base,
    s_base,
    table_ptr,
    pos,
    pos_ok,
    d,
    d_ok,
    like,
    stride_kv,
    stride_slot,
    stride_skv,
    stride_sslot,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """The tile of K and V [N, D] at positions `pos` of the sequence whose block-table row starts at
    table_ptr (k_base: the pool's K half at this KV head's channels d; V is stride_kv further); rows
    outside pos_ok and channels outside d_ok read 0. QUANT: the pool holds fp8 / int8 codes and s_base
    its scales (kv_quant.py: one per token, KV head and GROUP_SIZE channels): dequantized to `like`'s
    dtype as the torch backend's gather does (codes x scale in float32, then rounded). MASKED False:
    every position and channel valid, no mask."""
    slots = slots_at(table_ptr, pos, pos_ok, BLOCK_SIZE)
    if MASKED:
        m, other = pos_ok[:, None] & d_ok[None, :], 0.0
    else:
        m, other = None, None
    offs = slots[:, None] * stride_slot
    k = tl.load(k_base + offs, mask=m, other=other)
    v = tl.load(k_base + stride_kv + offs, mask=m, other=other)
    if QUANT:
        soffs = slots[:, None] * stride_sslot + (d // GROUP_SIZE)[None, :]
        ks = tl.load(s_base + soffs, mask=m, other=other)
        vs = tl.load(s_base + stride_skv + soffs, mask=m, other=other)
        k = (k.to(tl.float32) * ks.to(tl.float32)).to(like.dtype)
        v = (v.to(tl.float32) * vs.to(tl.float32)).to(like.dtype)
    return k, v


@triton.jit
def softmax_step(
    q,
    k,
    v,
    allowed,
    m_i,
    l_i,
    acc,
    qk_scale,
    cap_in,
    cap_out,
    USE_SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Fold one tile of keys into (max, sum, acc). q [M, D], k/v [N, D], allowed broadcasts to [M, N].
    Softcap: scale * s -> softcap * tanh(scale * s / softcap), with cap_in = scale / softcap and
    cap_out = softcap * log2(e); else qk_scale = scale * log2(e). UPCAST: dot in float32 (see dot_args)."""
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PREC)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if USE_SOFTCAP:
        s = tanh(s * cap_in) * cap_out
    else:
        s = s * qk_scale
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the second dot takes the probabilities in the K/V dtype, as SDPA does
    if UPCAST:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None], input_precision=DOT_PREC)
    else:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PREC)
    return m_new, l_i, acc


def scales(scale: float, softcap: float | None) -> tuple[float, float, float]:
    """(qk_scale, cap_in, cap_out) for softmax_step."""
    if softcap is None:
        return scale * LOG2E, 0.0, 0.0
    return scale * LOG2E, scale / softcap, softcap * LOG2E


def dot_args(dtype: torch.dtype) -> dict:
    """DOT_PREC and UPCAST for softmax_step. A float32 dot defaults to TF32 on tensor cores (~1e-3
    error) and the oracle comparison needs IEEE; other dtypes ignore the setting. Triton's interpreter
    holds bfloat16 as raw uint16 bits and multiplies those in tl.dot (seen in 3.9), so there the
    operands are widened to float32 first, after the same rounding the GPU path does."""
    upcast = dtype == torch.bfloat16 and triton_interpreted()
    return dict(DOT_PREC="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


def pool_args(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> tuple:
    """(scale tensor, its (K->V, slot, head) strides, {GROUP_SIZE, QUANT}) for a kernel reading the pool
    [2, slots, kv_heads, head_dim]: a quantized pool's scales [2, slots, kv_heads, groups], or for a
    plain pool the cache itself, never read."""
    if kv_scale is None:
        return kv_cache, (0, 0, 0), dict(GROUP_SIZE=1, QUANT=False)
    assert kv_scale.shape[:3] == kv_cache.shape[:3] and kv_scale.stride(3) == 1
    group_size = kv_cache.shape[3] // kv_scale.shape[3]
    return kv_scale, kv_scale.stride()[:3], dict(GROUP_SIZE=group_size, QUANT=True)
