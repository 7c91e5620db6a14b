"""Triton kernels for batched multi-LoRA: a grouped shrink then a grouped expand (Punica-style).

Layout. A batch of T rows (tokens) uses up to `num_slots` adapters at once; adapter s lives in slot s of
the stacked weights `A` [S1, K, IN] and `B` [S1, OUT, K], where K = n_slices * max_rank (the fused q/k/v
or gate/up slices are stacked along K of A and OUT of B, so a fused projection is one shrink and one
expand). Rows are grouped by slot without moving them: `perm` [T] lists the row indices of group 0, then
group 1, ..., and `offs` [S1] holds the cumulative group ends, so group s is rows
`perm[offs[s - 1] : offs[s]]` (group 0 starts at 0) and `offs[S1 - 1] == T`. Groups may be empty.
Groups s >= num_slots (the "base" group of rows without an adapter, usually the last, S1 = num_slots + 1)
are never launched: their rows of `y` are neither read nor written, so they stay bit-identical whatever
their A/B slots hold (even NaN).

Arithmetic (as PEFT computes it): h = x @ A[s].T is accumulated in fp32 and rounded to the activation
dtype d (PEFT's lora_A runs in the weight dtype); the expand h @ B[s].T accumulates in fp32, is added to
y in fp32, and the sum is stored as d. fp32 inputs use IEEE dots, since TF32 would cost ~1e-3 relative.

Kernels. Both launch over (row tiles, column tiles, slots). The row-tile axis is sized for the worst case
(every row in one group: cdiv(T, BLOCK_M)), and a program whose tile starts past its group's row count,
which it reads from `offs` on the device, returns at once. So grids depend only on shapes, nothing waits
on the host, and the launch is CUDA-graph safe.
- shrink: program (row tile x K tile, split, slot) gathers its rows of x through perm and multiplies them
  by A[s]^T over IN into an fp32 scratch h [T, K] indexed by sorted position (h row i belongs to row
  perm[i]). With little work per slot (decode: few rows, long IN like 4096 / 14336) IN is split over
  SPLIT_K programs, each storing its partial sum in its own plane of h [SPLIT_K, T, K]; the expand adds
  the planes in a fixed order (no zeroing kernel, no atomics: the result does not vary run to run).
- expand: program (row tile x OUT tile, slot) reads its sorted rows of h (the planes' sum), rounds them
  to d, multiplies by B[s]^T over K, and adds the tile into y at rows perm[i]. Each (row, column) of y
  has one writer.
tl.dot needs every tile dimension >= 16, so small K (rank 8) and odd sizes are padded and masked.
Block sizes follow fixed rules on the shapes (no autotuning: it is not CUDA-graph friendly).
Only APIs of Triton 3.6 are used.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _group_bounds(offs_ptr, slot):
    """Start and row count of group `slot` (int32 offs of cumulative ends)."""
    end = tl.load(offs_ptr + slot)
    start = tl.load(offs_ptr + tl.maximum(slot - 1, 0))
    start = tl.where(slot > 0, start, 0)
    return start, end - start


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    h_ptr,
    perm_ptr,
    offs_ptr,
    T,
    IN,
    K,
    xs_row,
    xs_col,
    SPLIT_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(K, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    pid_k = tl.program_id(1)
    slot = tl.program_id(2)
    start, count = _group_bounds(offs_ptr, slot)
    if pid_m * BLOCK_M >= count:
        return

    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local < count
    pos = (start + local).to(tl.int64)  # sorted position: the row of h
    rows = tl.load(perm_ptr + pos, mask=row_mask, other=0).to(tl.int64)  # the row of x
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of h = rows of A[slot]
    col_mask = cols < K
    a_base = a_ptr + slot.to(tl.int64) * K * IN

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, IN, BLOCK_K * SPLIT_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < IN
        xt = tl.load(
            x_ptr + rows[:, None] * xs_row + ks[None, :] * xs_col,
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        at = tl.load(  # [BLOCK_K, BLOCK_N] tile of A[slot]^T
            a_base + cols[None, :].to(tl.int64) * IN + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc = tl.dot(xt, at, acc, input_precision=DOT_PREC)

    # split k's partial sum: its own [T, K] plane of h (the expand adds the planes up)
    h_ptrs = h_ptr + pid_k.to(tl.int64) * T * K + pos[:, None] * K + cols[None, :]
    tl.store(h_ptrs, acc, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr,
    b_ptr,
    y_ptr,
    perm_ptr,
    offs_ptr,
    T,
    OUT,
    K,
    ys_row,
    ys_col,
    SPLIT_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    n_tiles = tl.cdiv(OUT, BLOCK_N)
    pid_m = tl.program_id(0) // n_tiles
    pid_n = tl.program_id(0) % n_tiles
    slot = tl.program_id(1)
    start, count = _group_bounds(offs_ptr, slot)
    if pid_m * BLOCK_M >= count:
        return

    local = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = local < count
    pos = (start + local).to(tl.int64)
    rows = tl.load(perm_ptr + pos, mask=row_mask, other=0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of y = rows of B[slot]
    col_mask = cols < OUT
    b_base = b_ptr + slot.to(tl.int64) * OUT * K

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        h_ptrs = h_ptr + pos[:, None] * K + ks[None, :]
        h_mask = row_mask[:, None] & k_mask[None, :]
        ht = tl.load(h_ptrs, mask=h_mask, other=0.0)
        for p in tl.static_range(1, SPLIT_K):  # the shrink's split partial sums, in a fixed order
            ht += tl.load(h_ptrs + p * T * K, mask=h_mask, other=0.0)
        ht = ht.to(b_ptr.dtype.element_ty)  # h rounds to the activation dtype, as PEFT's lora_A output does
        bt = tl.load(  # [BLOCK_K, BLOCK_N] tile of B[slot]^T
            b_base + cols[None, :].to(tl.int64) * K + ks[:, None],
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            ht = ht.to(tl.float32)
            bt = bt.to(tl.float32)
        acc = tl.dot(ht, bt, acc, input_precision=DOT_PREC)

    y_ptrs = y_ptr + rows[:, None] * ys_row + cols[None, :] * ys_col
    y_mask = row_mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=y_mask)


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
    upcast = dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    return dict(DOT_PREC="ieee" if dtype == torch.float32 or upcast else "tf32", UPCAST=upcast)


def _pow2_tile(n: int, lo: int = 16, hi: int = 64) -> int:
    """The power of two covering n, clamped to [lo, hi] (tl.dot needs >= 16)."""
    return max(lo, min(hi, triton.next_power_of_2(n)))


def _block_m(T: int) -> int:
    # decode batches are small and split over many groups: small row tiles waste less
    return 16 if T <= 64 else 32 if T <= 256 else 64


def _split_k(T: int, IN: int) -> int:
    """Programs along IN per row tile of the shrink. Measured on the H200 (benchmarks/lora.py --kernels,
    Llama-3.1-8B projections, 1 and 8 adapters): 8 for decode-sized batches (vs 16-32 before: every
    plane is read again by each expand program), fewer as rows grow, each keeping >= 512 of IN."""
    most = 8 if T <= 256 else 4 if T <= 1024 else 1
    return max(1, min(most, IN // 512))


def _expand_bn(T: int, OUT: int) -> int:
    """Columns of y per expand program: wide tiles (fewer programs re-reading h), measured best at 256
    for the 8B projections (128 for 4096-wide ones at 256 rows: within noise)."""
    return _pow2_tile(OUT, hi=256)


def lora_shrink(x, A, perm, offs, num_slots: int, split_k: int | None = None) -> torch.Tensor:
    """h [split, T, K] fp32: row i of plane p is the p-th partial sum of x[perm[i]] @ A[s].T, for the
    rows of groups s < num_slots (other rows: unwritten)."""
    T, IN = x.shape
    K = A.shape[1]
    assert A.is_contiguous() and x.dtype == A.dtype and A.shape[2] == IN
    assert perm.shape == (T,) and offs.dim() == 1 and 0 <= num_slots <= offs.shape[0] <= A.shape[0]
    block_m = _block_m(T)
    sn = _pow2_tile(K)  # shrink: columns of h per program
    sk = 32 if x.dtype == torch.float32 else 64  # shrink: IN step (fp32 tiles are twice the bytes)
    sk = _pow2_tile(IN, hi=sk)
    split_k = split_k or _split_k(T, IN)
    h = torch.empty((split_k, T, K), dtype=torch.float32, device=x.device)
    if T == 0 or num_slots == 0:
        return h
    grid = (triton.cdiv(T, block_m) * triton.cdiv(K, sn), split_k, num_slots)
    _lora_shrink_kernel[grid](
        x,
        A,
        h,
        perm,
        offs,
        T,
        IN,
        K,
        x.stride(0),
        x.stride(1),
        SPLIT_K=split_k,
        **_dot_args(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=sn,
        BLOCK_K=sk,
    )
    return h


def lora_expand(h, y, B, perm, offs, num_slots: int, expand_bn: int | None = None) -> None:
    """y[perm[i]] += round(sum of h's planes at row i) @ B[s].T in place, for the rows of groups s <
    num_slots (other rows untouched)."""
    split_k, T, K = h.shape
    OUT = y.shape[1]
    assert B.is_contiguous() and y.dtype == B.dtype and B.shape[1] == OUT and B.shape[2] == K
    if T == 0 or num_slots == 0:
        return
    block_m = _block_m(T)
    en = expand_bn or _expand_bn(T, OUT)  # expand: columns of y per program
    ek = _pow2_tile(K)  # expand: K step
    grid = (triton.cdiv(T, block_m) * triton.cdiv(OUT, en), num_slots)
    _lora_expand_kernel[grid](
        h,
        B,
        y,
        perm,
        offs,
        T,
        OUT,
        K,
        y.stride(0),
        y.stride(1),
        SPLIT_K=split_k,
        **_dot_args(y.dtype),
        BLOCK_M=block_m,
        BLOCK_N=en,
        BLOCK_K=ek,
        num_stages=2,  # one or two K steps per program: deeper pipelining only costs shared memory
    )


def _lora_add(
    x, y, A, B, perm, offs, num_slots: int, split_k: int | None = None, expand_bn: int | None = None
) -> None:
    """lora_add_triton with tile overrides (tests force the split path; the benchmark sweeps them)."""
    assert y.shape[0] == x.shape[0] and x.dtype == y.dtype
    h = lora_shrink(x, A, perm, offs, num_slots, split_k)
    lora_expand(h, y, B, perm, offs, num_slots, expand_bn)


def lora_add_triton(x, y, A, B, perm, offs, num_slots: int) -> None:
    """y[r] += (x[r] @ A[s].T) @ B[s].T in place, for every row r of every group s < num_slots.

    x [T, IN], y [T, OUT] (any strides), A [S1, K, IN] and B [S1, OUT, K] contiguous, all of one float
    dtype; perm [T] int64 row indices grouped by slot; offs [S1] int32 cumulative group ends. Rows of
    groups >= num_slots are not touched. No host synchronisation: safe to capture in a CUDA graph.
    """
    _lora_add(x, y, A, B, perm, offs, num_slots)
