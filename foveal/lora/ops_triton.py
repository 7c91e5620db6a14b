"""The Triton kernel of batched multi-LoRA on CUDA: the expand, after a base GEMM that did the shrink.

Layout (foveal/lora/stacks.py). Every slot's A sits under the linear's weight in one buffer W_ext =
[W; A_0; ...; A_{S-1}] ([out + S*K, in], K = n_slices * max_rank), so the step's GEMM ye = x @ W_ext^T
gives the base output ye[:, :out] and every slot's h = x @ A_s^T (ye[:, out + s*K : out + (s+1)*K])
at once, rounded to the activation dtype as PEFT's lora_A output is: the shrink costs a few percent more
weight rows in a GEMM that runs anyway, not kernels of its own. This kernel then writes each row's
output: ye[r, :out] + h_s(r) @ B[s]^T for the rows of adapter slot s, ye[r, :out] for base rows.

Rows are grouped by slot without moving them: `perm` [T] lists the row indices of group 0, then group 1,
..., and `offs` [S + 1] holds the cumulative group ends (group S: the base rows). The grid covers the
worst case (every row in one group: cdiv(T, BLOCK_M) row tiles per group), and a program whose tile
starts past its group's row count, read from `offs` on the device, returns at once: grids depend only on
shapes, nothing waits on the host, and one captured CUDA graph serves every mixture of adapters. Rows of
one group share each B tile (a grouped GEMM, Punica's SGMV idea), so eight adapters in a 64-row decode
step read each adapter's B once.

Measured on the H200 (benchmarks/RESULTS.md, issue 21): a separate shrink kernel (split-K) plus an
expand cost 6.7-14 us per 8B projection, about the floor of two dependent kernels; folding the shrink
into the GEMM took the 8-adapter batch-64 decode from 0.80x to 0.855x of the base model.

fp32 uses IEEE dots (TF32 would cost ~1e-3 relative). Only APIs of Triton 3.6 are used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foveal.config import triton_interpreted


@triton.jit
def _group_bounds(offs_ptr, slot):
    """Start and row count of group `slot` (int32 offs of cumulative ends)."""
    end = tl.load(offs_ptr + slot)
    start = tl.load(offs_ptr + tl.maximum(slot - 1, 0))
    start = tl.where(slot > 0, start, 0)
    return start, end - start


@triton.jit
def _lora_expand_fused_kernel(
    ye_ptr,
    b_ptr,
    out_ptr,
    perm_ptr,
    offs_ptr,
    num_slots,
    OUT,
    K,
    ye_row,
    out_row,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[r] = ye[r, :OUT] + ye[r, OUT + s*K : OUT + (s+1)*K] @ B[s].T for the rows r of group s; the
    base group (s == num_slots) copies ye[r, :OUT]."""
    n_tiles = tl.cdiv(OUT, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    slot = tl.program_id(1)
    start, count = _group_bounds(offs_ptr, slot)
    if pid_m * BLOCK_M >= count:
        return

    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local < count
    rows = tl.load(perm_ptr + (start + local).to(tl.int64), mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < OUT
    mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(ye_ptr + rows[:, None] * ye_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if slot < num_slots:
        b_base = b_ptr + slot.to(tl.int64) * OUT * K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            ht = tl.load(  # the row's h for its slot: the GEMM's extra columns (already rounded to d)
                ye_ptr + rows[:, None] * ye_row + OUT + slot * K + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )
            bt = tl.load(
                b_base + cols[None, :].to(tl.int64) * K + ks[:, None],
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            if UPCAST:
                ht = ht.to(tl.float32)
                bt = bt.to(tl.float32)
            acc = tl.dot(ht, bt, acc, input_precision=DOT_PREC)
        y += acc
    tl.store(out_ptr + rows[:, None] * out_row + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand_fused(ye, B, perm, offs, num_slots: int, out_features: int) -> torch.Tensor:
    """The LoRA linear's output [T, out]: ye = x @ [W; A_0; ...; A_{S-1}]^T (the base GEMM with every
    slot's A stacked under W, so one GEMM gives y and every slot's h), each row plus its own slot's
    h @ B[s]^T; rows of the base group (index num_slots of offs) copied. Every row is written."""
    T = ye.shape[0]
    K = B.shape[2]
    assert ye.stride(1) == 1 and B.is_contiguous() and ye.dtype == B.dtype and B.shape[1] == out_features
    out = torch.empty((T, out_features), dtype=ye.dtype, device=ye.device)
    if T == 0:
        return out
    block_m = _block_m(T)
    en = _expand_bn(T, out_features)
    grid = (triton.cdiv(T, block_m) * triton.cdiv(out_features, en), num_slots + 1)
    _lora_expand_fused_kernel[grid](
        ye,
        B,
        out,
        perm,
        offs,
        num_slots,
        out_features,
        K,
        ye.stride(0),
        out.stride(0),
        **_dot_args(ye.dtype),
        BLOCK_M=block_m,
        BLOCK_N=en,
        BLOCK_K=_pow2_tile(K),
        num_stages=2,
    )
    return out


def _dot_args(dtype: torch.dtype) -> dict:
    """DOT_PREC and UPCAST for the kernels. A float32 dot defaults to TF32 on tensor cores (~1e-3
    relative error), so fp32 asks for IEEE; 16-bit dtypes ignore the setting. Triton's interpreter holds
    bfloat16 as raw uint16 bits and multiplies those in tl.dot (seen in 3.9), so there bf16 operands are
    widened to float32 first: their products are exact in fp32, as on tensor cores."""
    upcast = dtype == torch.bfloat16 and triton_interpreted()
    return dict(DOT_PREC="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


def _pow2_tile(n: int, lo: int = 16, hi: int = 64) -> int:
    """The power of two covering n, clamped to [lo, hi] (tl.dot needs >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _block_m(T: int) -> int:
    # decode batches are small and split over many groups: small row tiles waste less
    return 16 if T <= 64 else 32 if T <= 256 else 64


def _expand_bn(T: int, OUT: int) -> int:
    """Columns of y per expand program: wide tiles (fewer programs re-reading h), measured best at 256
    for the 8B projections (128 for 4096-wide ones at 256 rows: within noise)."""
    return _pow2_tile(OUT, hi=256)
