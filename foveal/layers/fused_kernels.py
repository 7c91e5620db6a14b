"""Triton kernels behind foveal.layers.fused; imported by it on the first call, never by the CPU path.

Each kernel repeats torch's rounding steps (see fused.py), so the arithmetic must stay as written:
launches pass enable_fp_fusion=False because a contracted multiply-add (fma) rounds once where torch,
running one kernel per op, rounds twice. Where torch calls CUDA's accurate expf / rsqrtf / IEEE division,
the GPU build calls the same libdevice functions (`PRECISE`); Triton's default exp is an approximation.
Triton's CPU interpreter cannot call libdevice, so it uses numpy's functions instead (`PRECISE=False`).
Only APIs of Triton 3.6 are used.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from foveal.layers import pdl  # noqa: F401 (the launches' PDL arguments, for fused.py)
from foveal.layers.pdl import begin


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    rows_b,  # rows are indexed (a, b): a = row // rows_b, b = row % rows_b
    xs_a,
    xs_b,
    rs_a,
    rs_b,
    n_cols,
    eps,
    mean_arg,  # n on CPU, float(1 / n) on CUDA (see MEAN_BY_DIV)
    HAS_RESIDUAL: tl.constexpr,
    MEAN_BY_DIV: tl.constexpr,
    PRECISE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    a = row // rows_b
    b = row % rows_b
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + a * xs_a + b * xs_b + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + a * rs_a + b * rs_b + cols, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(res_out_ptr.dtype.element_ty)  # the residual stream rounds to x's dtype
        tl.store(res_out_ptr + row * n_cols + cols, h, mask=mask)
        x = h.to(tl.float32)
    total = tl.sum(x * x, axis=0)
    if MEAN_BY_DIV:  # torch's CPU mean is sum / n
        mean = tl.math.div_rn(total, mean_arg)
    else:  # its CUDA mean is sum * float(1 / n)
        mean = total * mean_arg
    if PRECISE:
        rstd = libdevice.rsqrt(mean + eps)
    else:
        rstd = tl.math.rsqrt(mean + eps)
    normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # a product of two 16-bit floats is exact in fp32: rounding it once is torch's 16-bit multiply
    tl.store(out_ptr + row * n_cols + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    inter,
    xs_row,
    PRECISE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * xs_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * xs_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if PRECISE:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e)  # torch: x / (1 + exp(-x)) in fp32, rounded to the dtype
    silu = silu.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(
    ptr,
    t,
    s_t,
    s_h,
    heads,
    c1,
    c2,
    s1,
    s2,
    half,
    w_ptr,
    eps,
    mean_arg,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    MEAN_BY_DIV: tl.constexpr,
    PRECISE: tl.constexpr,
):
    """Rotate `heads` heads of token t in place: [x1, x2] -> [x1*c1 - x2*s1, x2*c2 + x1*s2]; with NORM,
    each head first RMS-normalized with weight w (Qwen3's q/k norm, _rms_norm_kernel's steps)."""
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = (h < heads) & (d < half)
    p1 = ptr + t * s_t + h * s_h + d
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    dt = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if NORM:
        total = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if MEAN_BY_DIV:
            mean = tl.math.div_rn(total, mean_arg)
        else:
            mean = total * mean_arg
        if PRECISE:
            rstd = libdevice.rsqrt(mean + eps)[:, None]
        else:
            rstd = tl.math.rsqrt(mean + eps)[:, None]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    # torch: x * cos + cat(-x2, x1) * sin, each product rounded to the dtype, then the sum
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    tl.store(p1, o1.to(dt), mask=mask)
    tl.store(p1 + half, o2.to(dt), mask=mask)


@triton.jit
def _rotary_qk_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    qs_t,
    qs_h,
    ks_t,
    ks_h,
    cs_t,
    ss_t,
    num_q,
    num_k,
    half,
    eps,
    q_mean,
    k_mean,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    MEAN_BY_DIV: tl.constexpr,
    PRECISE: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    m = d < half
    c1 = tl.load(cos_ptr + t * cs_t + d, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * cs_t + half + d, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * ss_t + d, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * ss_t + half + d, mask=m, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr, t, qs_t, qs_h, num_q, c1, c2, s1, s2, half, qw_ptr, eps, q_mean, Q_HEADS, HALF, NORM,
        MEAN_BY_DIV, PRECISE,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, t, ks_t, ks_h, num_k, c1, c2, s1, s2, half, kw_ptr, eps, k_mean, K_HEADS, HALF, NORM,
        MEAN_BY_DIV, PRECISE,
    )  # fmt: skip


# libdevice's accurate exp/rsqrt, as torch's CUDA kernels call them; Triton's interpreter cannot call them
PRECISE = not isinstance(_rms_norm_kernel, InterpretedFunction)
