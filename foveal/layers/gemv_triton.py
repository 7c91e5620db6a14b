"""Decode-sized linears on CUDA: y = x @ W^T (+ bias) for a few rows of x, one Triton kernel, each program
a band of W's rows (y's columns) over all of K in steps of BLOCK_K, float32 sums.

Alone it reads W about as fast as cuBLAS (an earlier sweep: `benchmarks/gemv.py`, RESULTS.md "cuBLAS vs
a Triton GEMV"). What it adds is its place in a chain of programmatically dependent launches
(layers/pdl.py): W is no kernel's output, so each program loads its first tile of W before it waits for
the kernel before it (whose output is x). Behind an RMSNorm of one row, which occupies one SM, the
projection's programs are resident and have their first tiles in registers by the time x is ready; and
it takes no split-K reduce launch, so the kernel after it can launch early too.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from foveal.layers import pdl
from foveal.layers.pdl import gdc_launch_dependents, gdc_wait


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    x_row,
    y_row,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]) for this program's BLOCK_N columns n and every row
    m < M (BLOCK_M >= M), float32 sums of the products, rounded to y's type. With PDL the first tile of
    W (and the bias) is loaded before waiting for the previous kernel: neither is any kernel's output."""
    if PDL:
        gdc_launch_dependents()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    ks = tl.arange(0, BLOCK_K)
    w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & (ks < K)[None, :], other=0.0)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + m[:, None] * x_row + ks[None, :], mask=m_ok[:, None] & (ks < K)[None, :], other=0.0
        )
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        nk = ks + BLOCK_K  # the next step's tile (all masked past K)
        w = tl.load(w_rows + nk[None, :], mask=n_ok[:, None] & (nk < K)[None, :], other=0.0)
    if HAS_BIAS:
        acc += bias[None, :]
    y = y_ptr + m[:, None] * y_row + n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


class GemvTiles(NamedTuple):
    block_n: int  # W's rows (y's columns) a program
    block_k: int  # W's columns a step
    warps: int = 4


# Linears of at most this many rows of x (CUDA, 16-bit, W in x's type, contiguous) take the kernel instead
# of cuBLAS: 0 (off; FOVEAL_GEMV_ROWS sets it) until a GPU measures it in the models (`benchmarks/gemv.py`,
# `benchmarks/moe.py --gemv-rows 0,4`, `FOVEAL_GEMV_ROWS=4 benchmarks/gpu_workloads.py --workloads w1`)
GEMV_ROWS = int(os.environ.get("FOVEAL_GEMV_ROWS", "0"))
STEP_ELEMENTS = 8192  # BLOCK_M x BLOCK_N x BLOCK_K: the product tile a step (~64 fp32 registers a thread)


def gemv_tiles(M: int, N: int, K: int) -> GemvTiles:
    """~256 programs or more where N allows (bands of 4 to 64 rows), each step's product tile
    STEP_ELEMENTS (not swept yet)."""
    bm = triton.next_power_of_2(max(M, 1))
    bn = max(4, min(64, triton.next_power_of_2(max(1, N // 256) + 1) // 2))
    bk = max(32, min(triton.next_power_of_2(K), STEP_ELEMENTS // (bm * bn)))
    return GemvTiles(bn, bk)


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether linear() takes the kernel for x [..., K] and weight [N, K] (a CUDA tensor x)."""
    return (
        x.numel() <= GEMV_ROWS * x.shape[-1]
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and weight.dim() == 2
        and weight.is_contiguous()
        and x.shape[-1] == weight.shape[1]
        and x.numel() > 0
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tiles=None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T (+ bias [N]) -> [..., N] in x's type, by _gemv_kernel."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        t = tiles or gemv_tiles(M, N, K)
        _gemv_kernel[(triton.cdiv(N, t.block_n),)](
            x2, weight, weight if bias is None else bias, y, M, N, K, x2.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(M), BLOCK_N=t.block_n,
            BLOCK_K=t.block_k, num_warps=t.warps, **pdl.launch_args(x),
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], N)
