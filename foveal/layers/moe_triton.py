"""The experts of a mixture-of-experts layer on CUDA: one Triton grouped-GEMM kernel, launched for gate/up
and again for down, over the (token, expert) pairs sorted by expert.

    pairs      the T*k routing choices, pair p = token p // k's j-th expert (j = p % k)
    rows       the pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M with
               the sentinel T*k: [max_rows], max_rows = T*k + min(E, T*k) * (BLOCK_M - 1) rounded up
    experts    per BLOCK_M tile of `rows` its expert, or -1 past the last run: [max_rows / BLOCK_M]

Both come from device work alone, whose shapes depend only on T, k, E and BLOCK_M: no host sync, so a
CUDA graph holds the whole layer. `align` takes two launches (blocks of tokens counted per expert, then
placed in the order a stable sort by expert gives); `route_align` makes them and the routing (softmax,
top k, renormalization): for decode-sized steps (T*k pairs x E experts up to FUSED_MAX) in ONE program,
past that in align's two, the first routing its block of tokens. Up to ROUTER_FUSED_MAX_T tokens
`router_route_align` computes the router's logits in that one program's launch too.

A GEMM program takes one tile of rows (one expert) and one tile of columns: C[p] = A[row(p)] @ W[e]^T,
with A's row the token (gate/up: x gathered, no copy) or the pair (down: the activation's row), and for
down each row scaled by its routing weight. The pair-indexed down output [T*k, H] is summed over k per
token. Decode-sized steps can instead run each tile's whole expert MLP over one slice of the intermediate
columns in a single launch (_moe_small_kernel, SMALL_PAIRS), the slices' partial sums added with the k
pairs.

fp32 uses IEEE dots (as foveal/lora/ops_triton.py); tile sizes are picked per shape (`_tiles`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from foveal.layers import pdl
from foveal.layers.fp8 import FP8_DTYPES
from foveal.layers.fused_kernels import PRECISE
from foveal.layers.pdl import begin
from foveal.lora.ops_triton import _dot_args


@triton.jit
def _dot_w(
    acc, a, w_ptrs, w_mask, ws_ptrs, ws_mask, QB: tl.constexpr, UPCAST: tl.constexpr, DOT_PREC: tl.constexpr
):
    """acc + a @ (the W tile at w_ptrs): fp8 W (QB > 0) taken in a's type, each K step's product times its
    columns' block scales (at ws_ptrs)."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if QB > 0:  # fp8 values are exact in A's type; their block's scale multiplies the partial product
        w = w.to(a.dtype)
    if UPCAST:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if QB > 0:
        acc += tl.dot(a, w, input_precision=DOT_PREC) * tl.load(ws_ptrs, mask=ws_mask, other=0.0)[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _tile_pairs(rows_ptr, tile, num_pairs, BLOCK_M: tl.constexpr):
    """(pairs as int64 (0 for padding), valid) of one BLOCK_M tile of the aligned rows."""
    pairs = tl.load(rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    return tl.where(valid, pairs, 0).to(tl.int64), valid


@triton.jit
def _glu(gate, up, ACT: tl.constexpr, alpha, limit):
    """The experts' activation of float32 gate and up: 1, silu(gate) * up; 2, gpt-oss's clamped SwiGLU."""
    if ACT == 1:
        return gate / (1.0 + tl.exp(-gate)) * up
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return (up + 1.0) * gate / (1.0 + tl.exp(-gate * alpha))


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    c_ptr,
    scale_ptr,
    rows_ptr,
    experts_ptr,
    ws_ptr,
    num_pairs,
    N,
    K,
    a_row,
    c_row,
    ws_e,
    ws_n,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    GATHER: tl.constexpr,
    SCALE: tl.constexpr,
    BIAS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    QB: tl.constexpr,
    COLS_FIRST: tl.constexpr,
    GLU_OUT: tl.constexpr,
    PRECISE_EXP: tl.constexpr,
    PDL: tl.constexpr,
):
    """C[p, :N] = (A[p // TOP_K if GATHER else p] @ W[e, :N, :K]^T + bias[e] if BIAS) (times scale[p] if
    SCALE) for the pairs p of this program's tile of rows, all of expert e. ACT > 0: A's row is the
    gate/up output [gate (K) | up (K)] and the kernel takes glu(gate, up) (1: silu(gate) * up, 2:
    gpt-oss's clamped SwiGLU with alpha and limit), in float32, rounded to A's type for the dot.
    SPLIT_K > 1: program (., ., s) takes the s-th of SPLIT_K runs of K (whole BLOCK_Ks) and writes its
    partial product (the bias in s = 0's) to C's rows s * num_pairs + p, for the caller to sum.
    QB > 0: W is fp8 with one float32 scale per QB x QB block (ws[e, n // QB, k // QB], strides ws_e,
    ws_n, 1; BLOCK_K divides QB, so a K step takes one scale a column): each W tile taken in A's type
    (e4m3 values are exact in bf16, fp16 and fp32), each K step's product scaled per column in float32.
    COLS_FIRST: the grid is (column tiles, row tiles, splits), so a row tile's column programs run side
    by side and its A rows come from HBM once; else (row tiles, column tiles, splits).
    GLU_OUT: W is gate/up's [E, 2N, K] and C[p, :N] = silu(gate) * up of the program's columns of both
    halves (two accumulators; bias and scales per half), each half rounded to C's type first and the
    silu as fused.silu_and_mul takes it (libdevice's exp where PRECISE_EXP), so C is what gate/up then
    silu_and_mul would give."""
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    tile = tl.program_id(1) if COLS_FIRST else tl.program_id(0)
    e = tl.load(experts_ptr + tile)
    if e < 0:
        return
    pairs, valid = _tile_pairs(rows_ptr, tile, num_pairs, BLOCK_M)
    src = pairs // TOP_K if GATHER else pairs
    cols = (tl.program_id(0) if COLS_FIRST else tl.program_id(1)) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = 2 * N if GLU_OUT else N  # W's rows an expert
    w_base = w_ptr + e.to(tl.int64) * w_rows * K
    ws_base = ws_ptr + e.to(tl.int64) * ws_e
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GLU_OUT: the up half's
    k_lo = 0
    k_hi = K
    out_rows = pairs
    if SPLIT_K > 1:  # (compile-time: one split is the plain loop over K)
        k_run = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = tl.program_id(2) * k_run
        k_hi = tl.minimum(K, k_lo + k_run)
        out_rows = pairs + tl.program_id(2) * num_pairs
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a_mask = valid[:, None] & k_mask[None, :]
        a = tl.load(a_ptr + src[:, None] * a_row + ks[None, :], mask=a_mask, other=0.0)
        if ACT > 0:
            gate = a.to(tl.float32)
            up = tl.load(a_ptr + src[:, None] * a_row + K + ks[None, :], mask=a_mask, other=0.0).to(
                tl.float32
            )
            a = _glu(gate, up, ACT, alpha, limit).to(a_ptr.dtype.element_ty)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_ptrs = w_base + cols[None, :].to(tl.int64) * K + ks[:, None]
        ws_ptrs = ws_base + (cols // QB if QB > 0 else cols) * ws_n + k0 // (QB if QB > 0 else 1)
        acc = _dot_w(acc, a, w_ptrs, w_mask, ws_ptrs, col_mask, QB, UPCAST, DOT_PREC)
        if GLU_OUT:  # the up half: rows N + cols
            ws_up = ws_base + ((N + cols) // QB if QB > 0 else cols) * ws_n + k0 // (QB if QB > 0 else 1)
            acc_up = _dot_w(acc_up, a, w_ptrs + N * K, w_mask, ws_up, col_mask, QB, UPCAST, DOT_PREC)
    if BIAS:
        b_row = bias_ptr + e.to(tl.int64) * w_rows
        bias = tl.load(b_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(tl.program_id(2) == 0, bias, 0.0)
        acc += bias[None, :]
        if GLU_OUT:
            acc_up += tl.load(b_row + N + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GLU_OUT:  # as gate/up's output rounded to C's type, then silu_and_mul
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        if PRECISE_EXP:
            ex = libdevice.exp(-gate)
        else:
            ex = tl.exp(-gate)
        silu = tl.math.div_rn(gate, 1.0 + ex).to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = silu * up
    if SCALE:
        acc *= tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c = c_ptr + out_rows[:, None] * c_row + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & col_mask[None, :])


@triton.jit
def _moe_small_kernel(
    x_ptr,
    w13_ptr,
    w2_ptr,
    b13_ptr,
    b2_ptr,
    part_ptr,
    scale_ptr,
    rows_ptr,
    experts_ptr,
    ws13_ptr,
    ws2_ptr,
    num_pairs,
    H,
    INTER,
    x_row,
    ws13_e,
    ws13_n,
    ws2_e,
    ws2_n,
    alpha,
    limit,
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    BIAS_UP: tl.constexpr,
    BIAS_DOWN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
    QB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """A whole expert MLP for one tile of rows (pairs of expert e) and one slice of the intermediate
    columns, i = s * BLOCK_I ..: gate and up of those columns (x's rows gathered, two accumulators over
    H), each rounded to x's type as gate/up's output would be, glu (ACT 1: silu(gate) * up, 2: gpt-oss's
    clamped SwiGLU) rounded again, then that slice's share of down, (glu_s @ W2[e, :, slice]^T + bias[e]
    if s = 0) times the pair's weight, in float32 into part[s * num_pairs + p, :H]: the sum over s of
    these is what gate/up then down give, so pair_sum(part, splits=S) finishes the layer. QB > 0: fp8
    weights with block scales as in _moe_gemm_kernel (BLOCK_I and BLOCK_K divide QB)."""
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    tile = tl.program_id(0)
    s = tl.program_id(1)
    e = tl.load(experts_ptr + tile)
    if e < 0:
        return
    pairs, valid = _tile_pairs(rows_ptr, tile, num_pairs, BLOCK_M)
    src = pairs // TOP_K
    ic = s * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = ic < INTER
    e64 = e.to(tl.int64)
    w13 = w13_ptr + e64 * 2 * INTER * H
    ws13 = ws13_ptr + e64 * ws13_e
    gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(
            x_ptr + src[:, None] * x_row + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        w_ptrs = w13 + ic[None, :].to(tl.int64) * H + ks[:, None]
        w_mask = k_ok[:, None] & i_ok[None, :]
        kq = k0 // (QB if QB > 0 else 1)
        ws_gate = ws13 + (ic // QB if QB > 0 else ic) * ws13_n + kq
        ws_up = ws13 + ((INTER + ic) // QB if QB > 0 else ic) * ws13_n + kq
        gate = _dot_w(gate, a, w_ptrs, w_mask, ws_gate, i_ok, QB, UPCAST, DOT_PREC)
        up = _dot_w(up, a, w_ptrs + INTER * H, w_mask, ws_up, i_ok, QB, UPCAST, DOT_PREC)
    if BIAS_UP:
        gate += tl.load(b13_ptr + e64 * 2 * INTER + ic, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b13_ptr + e64 * 2 * INTER + INTER + ic, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    gate = gate.to(x_ptr.dtype.element_ty).to(tl.float32)  # gate/up's output, as stored by its launch
    up = up.to(x_ptr.dtype.element_ty).to(tl.float32)
    act = _glu(gate, up, ACT, alpha, limit).to(x_ptr.dtype.element_ty)
    scale = tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    w2 = w2_ptr + e64 * H * INTER
    ws2 = ws2_ptr + e64 * ws2_e
    out = part_ptr + (s * num_pairs + pairs)[:, None] * H
    for n0 in range(0, H, BLOCK_N):
        ns = n0 + tl.arange(0, BLOCK_N)
        n_ok = ns < H
        w_ptrs = w2 + ns[None, :].to(tl.int64) * INTER + ic[:, None]
        ws_ptrs = ws2 + (ns // QB if QB > 0 else ns) * ws2_n + s * BLOCK_I // (QB if QB > 0 else 1)
        d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        d = _dot_w(d, act, w_ptrs, i_ok[:, None] & n_ok[None, :], ws_ptrs, n_ok, QB, UPCAST, DOT_PREC)
        if BIAS_DOWN:
            bias = tl.load(b2_ptr + e64 * H + ns, mask=n_ok, other=0.0).to(tl.float32)
            d += tl.where(s == 0, bias, 0.0)[None, :]
        tl.store(out + ns[None, :], d * scale[:, None], mask=valid[:, None] & n_ok[None, :])


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [max_rows] int32, experts [max_rows / block_m] int32) for the routing choices ids [T, k]:
    the pairs sorted by expert (pair order within each expert's run, as a stable sort gives), each run
    padded to block_m with the sentinel T*k, and each tile's expert (-1 past the runs). Two launches
    (blocks of tokens counted, then placed); shapes depend on T, k, E and block_m alone."""
    T, k = ids.shape
    return _align_launches(None, ids.contiguous(), None, T, k, num_experts, False, block_m)


FUSED_MAX = 32768  # pairs (padded) x experts (padded) that route_align takes in one program


@triton.jit
def _top_k(x, e, e_ok, j, TOP_K: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
           BLOCK_E: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
    """(weights [BLOCK_T, K_PAD] float32, ids int32): softmax over each row of the logits x [BLOCK_T,
    BLOCK_E] (experts past e_ok left out), its TOP_K largest (first index on ties) and their weights,
    renormalized to sum to 1 when RENORM; columns j >= TOP_K are zeros."""
    x = tl.where(e_ok[None, :], x.to(tl.float32), float("-inf"))  # padding rows stay finite
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.max(p, 1)
        arg = tl.min(tl.where(p == best[:, None], e[None, :], BLOCK_E), 1)
        w = tl.where(j[None, :] == i, best[:, None], w)
        ids = tl.where(j[None, :] == i, arg[:, None], ids)
        p = tl.where(e[None, :] == arg[:, None], -1.0, p)
    if RENORM:
        w = w / tl.sum(w, 1)[:, None]
    return w, ids


@triton.jit
def _route_count_kernel(
    logits_ptr,
    l_row,
    weights_ptr,
    ids_ptr,
    ranks_ptr,
    counts_ptr,
    rows_ptr,
    T,
    E,
    n_rows,
    ROUTE: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """The first of align's two launches, for program p's BLOCK_T tokens: with ROUTE their softmax top
    k (_top_k) from the logits, stored as weights and ids, else their ids loaded; each pair's rank among
    this block's pairs of its expert (pair order) into ranks, the block's pairs per expert into
    counts[p, :E], and the sentinel T * TOP_K into this program's BLOCK_R slice of rows."""
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, K_PAD)
    t_ok = t < T
    e_ok = e < E
    ok = t_ok[:, None] & (j[None, :] < TOP_K)
    pair = t[:, None] * TOP_K + j[None, :]
    if ROUTE:
        x = tl.load(
            logits_ptr + t[:, None] * l_row + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0
        )
        w, ids = _top_k(x, e, e_ok, j, TOP_K, RENORM, BLOCK_T, BLOCK_E, K_PAD)
        tl.store(weights_ptr + pair, w, mask=ok)
        tl.store(ids_ptr + pair, ids.to(tl.int64), mask=ok)
    else:
        ids = tl.load(ids_ptr + pair, mask=ok, other=0).to(tl.int32)
    pair = tl.reshape(pair, [BLOCK_T * K_PAD])
    eid = tl.reshape(ids, [BLOCK_T * K_PAD])
    ok = tl.reshape(ok, [BLOCK_T * K_PAD])
    hot = ((eid[:, None] == e[None, :]) & ok[:, None]).to(tl.int32)
    rank = tl.sum(tl.where(hot != 0, tl.cumsum(hot, 0), 0), 1) - 1
    tl.store(ranks_ptr + pair, rank, mask=ok)
    tl.store(counts_ptr + pid * BLOCK_E + e, tl.sum(hot, 0))
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    tl.store(rows_ptr + r, tl.full([BLOCK_R], 0, tl.int32) + T * TOP_K, mask=r < n_rows)


@triton.jit
def _route_place_kernel(
    ids_ptr,
    ranks_ptr,
    counts_ptr,
    rows_ptr,
    experts_ptr,
    T,
    E,
    n_progs,
    n_tiles,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
):
    """The second: every block's counts summed (whole: each expert's padded run; over blocks before this
    one: where this block's pairs of an expert start in its run), program p's pairs written to rows at
    run start + earlier blocks' pairs + rank (the pair order a stable sort by expert gives), and its
    BLOCK_TILES slice of the tiles' experts (-1 past the runs)."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    total = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, n_progs, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        counts = tl.load(counts_ptr + c[:, None] * BLOCK_E + e[None, :], mask=(c < n_progs)[:, None], other=0)
        total += tl.sum(counts, 0)
        before += tl.sum(tl.where((c < pid)[:, None], counts, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    start = pad_end - padded + before  # this block's first row of each expert's run
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, K_PAD)
    ok = tl.reshape((t < T)[:, None] & (j[None, :] < TOP_K), [BLOCK_T * K_PAD])
    pair = tl.reshape(t[:, None] * TOP_K + j[None, :], [BLOCK_T * K_PAD])
    eid = tl.load(ids_ptr + pair, mask=ok, other=0).to(tl.int32)
    rank = tl.load(ranks_ptr + pair, mask=ok, other=0)
    dest = tl.sum(tl.where(eid[:, None] == e[None, :], start[None, :], 0), 1) + rank
    tl.store(rows_ptr + dest, pair, mask=ok)
    tiles = pid * BLOCK_TILES + tl.arange(0, BLOCK_TILES)
    ex = tl.sum(((pad_end[None, :] <= tiles[:, None] * BLOCK_M) & e_ok[None, :]).to(tl.int32), 1)
    tl.store(experts_ptr + tiles, tl.where(ex < E, ex, -1), mask=tiles < n_tiles)


def _route_blocks(T: int, top_k: int, E: int) -> int:
    """Tokens a program of align's two launches takes: a one-hot of ~4,096 elements, more where the step
    would otherwise need more than 256 programs (each placing program sums every program's counts)."""
    kp, be = triton.next_power_of_2(top_k), triton.next_power_of_2(E)
    bt = max(max(1, 4096 // (kp * be)), triton.next_power_of_2(triton.cdiv(T, 256)))
    return min(bt, triton.next_power_of_2(max(T, 1)))


def _align_launches(logits, ids, weights, T: int, top_k: int, E: int, renormalize: bool, block_m: int):
    """align's two launches (_route_count_kernel, _route_place_kernel): with logits, the routing too into
    weights and ids; else ids given. Returns (rows, experts)."""
    n = T * top_k
    n_rows = triton.cdiv(n + min(E, n) * (block_m - 1), block_m) * block_m
    n_tiles = n_rows // block_m
    if n == 0:
        return torch.empty(0, dtype=torch.int32, device=ids.device), torch.empty(
            0, dtype=torch.int32, device=ids.device
        )
    kp, be = triton.next_power_of_2(top_k), triton.next_power_of_2(E)
    bt = _route_blocks(T, top_k, E)
    progs = triton.cdiv(T, bt)
    dev = ids.device
    rows = torch.empty(n_rows, dtype=torch.int32, device=dev)
    experts = torch.empty(n_tiles, dtype=torch.int32, device=dev)
    ranks = torch.empty(n, dtype=torch.int32, device=dev)
    counts = torch.empty((progs, be), dtype=torch.int32, device=dev)
    route = logits is not None
    warps = _route_warps(bt * kp * be)
    _route_count_kernel[(progs,)](
        logits if route else ids, logits.stride(0) if route else 0, weights if route else ranks, ids, ranks,
        counts, rows, T, E, n_rows, ROUTE=route, TOP_K=top_k, K_PAD=kp, RENORM=renormalize, BLOCK_T=bt,
        BLOCK_E=be, BLOCK_R=triton.next_power_of_2(triton.cdiv(n_rows, progs)), num_warps=warps,
    )  # fmt: skip
    _route_place_kernel[(progs,)](
        ids, ranks, counts, rows, experts, T, E, progs, n_tiles, TOP_K=top_k, K_PAD=kp, BLOCK_T=bt,
        BLOCK_E=be, BLOCK_M=block_m, BLOCK_C=max(1, min(triton.next_power_of_2(progs), 4096 // be)),
        BLOCK_TILES=triton.next_power_of_2(triton.cdiv(n_tiles, progs)), num_warps=warps,
    )  # fmt: skip
    return rows, experts


@triton.jit
def _route_align(
    logits_ptr,
    l_row,
    weights_ptr,
    ids_ptr,
    rows_ptr,
    experts_ptr,
    T,
    E,
    n_rows,
    n_tiles,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    L2_ONLY: tl.constexpr,
):
    """route() and align() of all T tokens by one program (route_align launches it alone;
    _router_route_align_kernel's last program calls it): softmax over each row of logits, its TOP_K
    largest (first index on ties) and their weights, then the pairs (t * TOP_K + j) counted per expert,
    each ranked among its expert's pairs in pair order (a cumulative sum over a one-hot matrix), and
    written to its expert's padded run; each BLOCK_M tile's expert (-1 past the runs). L2_ONLY: the
    logits loaded past this SM's L1 (other programs wrote them)."""
    t = tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    mask = t_ok[:, None] & e_ok[None, :]
    if L2_ONLY:  # other programs wrote the logits: not from this SM's L1
        x = tl.load(logits_ptr + t[:, None] * l_row + e[None, :], mask=mask, other=0.0, cache_modifier=".cg")
    else:
        x = tl.load(logits_ptr + t[:, None] * l_row + e[None, :], mask=mask, other=0.0)
    j = tl.arange(0, K_PAD)
    w, ids = _top_k(x, e, e_ok, j, TOP_K, RENORM, BLOCK_T, BLOCK_E, K_PAD)
    ok = t_ok[:, None] & (j[None, :] < TOP_K)
    pair = t[:, None] * TOP_K + j[None, :]
    tl.store(weights_ptr + pair, w, mask=ok)
    tl.store(ids_ptr + pair, ids.to(tl.int64), mask=ok)
    # align: [T x K_PAD] flattened in pair order, one-hot over the experts
    n = T * TOP_K
    pair = tl.reshape(pair, [BLOCK_T * K_PAD])
    eid = tl.reshape(ids, [BLOCK_T * K_PAD])
    ok = tl.reshape(ok, [BLOCK_T * K_PAD])
    hot = ((eid[:, None] == e[None, :]) & ok[:, None]).to(tl.int32)
    rank = tl.sum(tl.where(hot != 0, tl.cumsum(hot, 0), 0), 1) - 1  # earlier pairs of its expert
    counts = tl.sum(hot, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    dest = tl.sum(tl.where(hot != 0, (pad_end - padded)[None, :], 0), 1) + rank
    r = tl.arange(0, BLOCK_R)
    tl.store(rows_ptr + r, tl.full([BLOCK_R], 0, tl.int32) + n, mask=r < n_rows)
    tl.debug_barrier()  # the sentinels land before the pairs overwrite theirs
    tl.store(rows_ptr + dest, pair, mask=ok)
    starts = tl.arange(0, BLOCK_TILES) * BLOCK_M
    ex = tl.sum(((pad_end[None, :] <= starts[:, None]) & e_ok[None, :]).to(tl.int32), 1)
    tl.store(
        experts_ptr + tl.arange(0, BLOCK_TILES),
        tl.where(ex < E, ex, -1),
        mask=tl.arange(0, BLOCK_TILES) < n_tiles,
    )


@triton.jit
def _router_route_align_kernel(
    x_ptr,
    x_row,
    w_ptr,
    b_ptr,
    logits_ptr,
    done_ptr,
    weights_ptr,
    ids_ptr,
    rows_ptr,
    experts_ptr,
    T,
    E,
    H,
    n_rows,
    n_tiles,
    HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_TILES: tl.constexpr,
    BLOCK_EP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    """The router's logits and _route_align in one launch: program p computes the logits of experts
    [p * BLOCK_EP, (p + 1) * BLOCK_EP) for all T tokens (float32 sums, plus the bias, rounded to x's
    type as the router's Linear would give them) into logits_ptr [T, E], then counts itself done on
    done_ptr; the program that counts last routes and aligns (and sets the count back to 0 for the
    next launch)."""
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    t = tl.arange(0, BLOCK_T)
    e = tl.program_id(0) * BLOCK_EP + tl.arange(0, BLOCK_EP)
    t_ok = t < T
    e_ok = e < E
    acc = tl.zeros([BLOCK_T, BLOCK_EP], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < H
        xs = tl.load(x_ptr + t[:, None] * x_row + h[None, :], mask=t_ok[:, None] & h_ok[None, :], other=0.0)
        ws = tl.load(w_ptr + e[:, None].to(tl.int64) * H + h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                     other=0.0)  # fmt: skip
        acc += tl.sum(xs.to(tl.float32)[:, None, :] * ws.to(tl.float32)[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(logits_ptr + t[:, None] * E + e[None, :], logits, mask=t_ok[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits stored before the count says so
    if tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        _route_align(
            logits_ptr, E, weights_ptr, ids_ptr, rows_ptr, experts_ptr, T, E, n_rows, n_tiles, TOP_K, K_PAD,
            RENORM, BLOCK_T, BLOCK_E, BLOCK_M, BLOCK_R, BLOCK_TILES, True,
        )  # fmt: skip
        tl.store(done_ptr, 0)


def _route_warps(one_hot: int) -> int:
    """route_align's warps for a one-hot of `one_hot` (tokens x top-k x experts, each a power of two)
    elements: one warp per 1,024, from 1 to 8."""
    return max(1, min(8, one_hot // 1024))


def route_align(
    logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int, num_warps: int | None = None
):
    """(weights [T, k] float32, ids [T, k] int64, rows, experts): moe.route(logits, top_k, renormalize)
    and align(ids, E, block_m), in one launch where the step is small enough (FUSED_MAX), else in
    align's two (the first routing each block of tokens). `num_warps`: the one program's (by default
    from the one-hot's size: 1 warp up to 1,024 elements, 8 from 8,192; the fastest in RESULTS.md
    session 34's sweep at each end)."""
    T, E = logits.shape
    bt, be, kp = triton.next_power_of_2(max(T, 1)), triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    n = T * top_k
    dev = logits.device
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.long, device=dev)
    if T == 0 or bt * kp * be > FUSED_MAX:  # larger steps: blocks of tokens routed and counted, then placed
        return weights, ids, *_align_launches(logits, ids, weights, T, top_k, E, renormalize, block_m)
    n_rows = triton.cdiv(n + min(E, n) * (block_m - 1), block_m) * block_m
    rows = torch.empty(n_rows, dtype=torch.int32, device=dev)
    experts = torch.empty(n_rows // block_m, dtype=torch.int32, device=dev)
    _route_align[(1,)](
        logits, logits.stride(0), weights, ids, rows, experts, T, E, n_rows, n_rows // block_m,
        TOP_K=top_k, K_PAD=kp, RENORM=renormalize, BLOCK_T=bt, BLOCK_E=be, BLOCK_M=block_m,
        BLOCK_R=triton.next_power_of_2(n_rows), BLOCK_TILES=triton.next_power_of_2(n_rows // block_m),
        L2_ONLY=False, num_warps=num_warps or _route_warps(bt * kp * be),
    )  # fmt: skip
    return weights, ids, rows, experts


ROUTER_FUSED_MAX_T = 8  # tokens whose router logits route_align's launch computes itself (decode steps)


def router_route_align(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    done: torch.Tensor,
    top_k: int,
    renormalize: bool,
    block_m: int,
    num_warps: int | None = None,
):
    """route_align(x @ weight^T + bias, ...) with the router's GEMV inside the launch: ~16 programs
    each take a slice of the experts' logits and the last to finish routes and aligns (no launch for
    the router, none between). `done`: an int32 zero this layer owns (the programs count on it; the last
    sets it back). `num_warps`: each program's (by default 1 up to a one-hot of 1,024 elements, the
    fastest at one token in RESULTS.md session 34, else 4). None where the step is larger than
    ROUTER_FUSED_MAX_T tokens or route_align's one program (the caller computes the logits then)."""
    T, H = x.shape
    E = weight.shape[0]
    bt, be, kp = triton.next_power_of_2(max(T, 1)), triton.next_power_of_2(E), triton.next_power_of_2(top_k)
    if T == 0 or T > ROUTER_FUSED_MAX_T or bt * kp * be > FUSED_MAX:
        return None
    if x.stride(1) != 1 or not weight.is_contiguous() or weight.dtype != x.dtype:
        return None
    n = T * top_k
    n_rows = triton.cdiv(n + min(E, n) * (block_m - 1), block_m) * block_m
    dev = x.device
    logits = torch.empty((T, E), dtype=torch.float32, device=dev)
    weights = torch.empty((T, top_k), dtype=torch.float32, device=dev)
    ids = torch.empty((T, top_k), dtype=torch.long, device=dev)
    rows = torch.empty(n_rows, dtype=torch.int32, device=dev)
    experts = torch.empty(n_rows // block_m, dtype=torch.int32, device=dev)
    block_ep = max(2, min(8, be // 16))  # ~16 programs share the router's weights
    _router_route_align_kernel[(triton.cdiv(E, block_ep),)](
        x, x.stride(0), weight, weight if bias is None else bias, logits, done, weights, ids, rows, experts,
        T, E, H, n_rows, n_rows // block_m, HAS_BIAS=bias is not None, TOP_K=top_k, K_PAD=kp,
        RENORM=renormalize, BLOCK_T=bt, BLOCK_E=be, BLOCK_M=block_m, BLOCK_R=triton.next_power_of_2(n_rows),
        BLOCK_TILES=triton.next_power_of_2(n_rows // block_m), BLOCK_EP=block_ep,
        BLOCK_H=min(triton.next_power_of_2(H), max(64, 1024 // bt)),
        num_warps=num_warps or (1 if bt * kp * be <= 1024 else 4), **pdl.launch_args(x),
    )  # fmt: skip
    return weights, ids, rows, experts


class Tiles(NamedTuple):
    block_m: int  # rows (pairs of one expert) a program takes: what align pads each run to
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 2
    split_k: int = 1  # down only: K in this many runs, each its own programs, partial sums summed after
    cols_first: int = 0  # 1: a row tile's column programs launched side by side (its A rows read once)


# Prefill-sized steps take 128-row tiles from this many pairs an expert on average (measured better at 512:
# Qwen3-30B-A3B's 8,192-token steps; at 32, its 512-token ones, 2% slower in one run with the silu in
# gate/up's epilogue; RESULTS.md session 37; between, not measured)
LARGE_TILE_PER_EXPERT = 128
# down's programs (row tiles x column tiles) up to which it splits K in 4 runs, and in 2 (16-row tiles)
SPLIT_K_PROGRAMS = (128, 1024)


def _tiles(
    n_pairs: int,
    num_experts: int,
    N: int,
    K: int,
    down: bool,
    itemsize: int = 2,
    fused_act: bool = False,
    glu_out: bool = False,
) -> Tiles:
    """The tiles of one GEMM (gate/up, or down when `down`; `fused_act`: down takes the activation inside
    its loads) from the sweeps of `benchmarks/moe.py --parts tiles` (RESULTS.md). Decode-sized steps
    (H100, bf16, Qwen3-30B-A3B's and gpt-oss-20b's shapes at 1, 64 and 256 tokens; session 33): 16-row
    tiles while an expert gets <= 16 pairs on average, else 64 (one row tile for both GEMMs, so the rows
    are aligned once; experts_triton aligns again for down's where they differ); gate/up 64 (16 rows) or
    128 columns deep 128, down 128 columns deep 64; 4 warps, 4 stages (2 for fp32: shared memory). Down
    takes 3 stages, and K in 4 runs while it would have at most 128 programs (one token: 92 and 128), in
    2 up to 1,024 with 16-row tiles (SPLIT_K_PROGRAMS): on the H100 at one token that took down 61.4 ->
    29.6 us (gpt-oss-20b) and 20.2 -> 14.2 us (Qwen3-30B-A3B) (session 34); at 2 and 8 tokens 2 runs
    were fastest or within 2% of it, 3 stages took 4-24% off 4 stages' time at 8 and 64 tokens, and 3
    stages were fastest at 256 (sessions 33, 35).

    Prefill-sized steps (> 2,048 pairs), 16-bit activations, at least LARGE_TILE_PER_EXPERT pairs an
    expert: 128 x 256 tiles deep 64, 8 warps, 3 stages, launched columns first, for both GEMMs: the
    fastest of the sweep at 8,192 tokens (H200, Qwen3-30B-A3B: 512 pairs an expert, down on the silu's
    own output; session 37): gate/up 1,179.5 -> 894.4 us, down 738.3 -> 467.6 us a layer, against 64 x
    128 x 64, 4 warps, 2 stages, rows first. That shape stays for fewer pairs an expert (at 32, one
    512-token prompt a step, the 128-row tiles are 3/4 padding: 2% slower, one run), where down takes
    the activation inside its loads (gpt-oss's clamped SwiGLU: its registers were not swept) and for
    fp32 (shared memory).
    `glu_out` (gate/up with the silu in its epilogue): half the columns of each of its two halves, the
    same products a program (not swept)."""
    per_expert = n_pairs / max(1, min(num_experts, n_pairs))
    if n_pairs > 2048:
        bn, bk = triton.next_power_of_2(N // 2 if glu_out else N), max(16, min(64, triton.next_power_of_2(K)))
        if itemsize > 2 or (down and fused_act) or per_expert < LARGE_TILE_PER_EXPERT:
            return Tiles(64, max(16, min(128, bn)), bk)
        # glu_out: two accumulators of 128 columns (gate's and up's), the products of 128 x 256
        return Tiles(128, max(16, min(128 if glu_out else 256, bn)), bk, 8, 3, 1, 1)
    bm = 16 if per_expert <= 16 else 64
    bn, bk = (128, 64) if down else (64 if bm == 16 else 128, 128)
    stages = 4 if itemsize <= 2 else 2
    if itemsize > 2:
        bk = min(bk, 64)
    bn = max(16, min(bn, triton.next_power_of_2(N)))
    bk = max(16, min(bk, triton.next_power_of_2(K)))
    if down and itemsize <= 2:
        programs = min(num_experts, n_pairs) * triton.cdiv(N, bn)
        split = (
            4 if programs <= SPLIT_K_PROGRAMS[0] else 2 if programs <= SPLIT_K_PROGRAMS[1] and bm == 16 else 1
        )
        return Tiles(bm, bn, bk, 4, 3, split)
    return Tiles(bm, bn, bk, 4, stages)


class SmallTiles(NamedTuple):
    """_moe_small_kernel's: intermediate columns a program (its slice), gate/up's depth, down's columns a
    step, warps, stages."""

    block_i: int = 64
    block_k: int = 128
    block_n: int = 128
    warps: int = 4
    stages: int = 4


# Steps of at most SMALL_PAIRS pairs, of experts at most SMALL_MAX_INTER wide, run the experts in one
# launch, each program a whole expert MLP over a slice of the intermediate (_moe_small_kernel), instead
# of gate/up's and down's. One token of Qwen3-30B-A3B (8 pairs, 768 wide), H100, 8 layers from a graph
# (`benchmarks/moe.py --parts small`, RESULTS.md session 38): 36.4 -> 32.2 us a layer, decode step 4.08
# -> 3.95 ms; at 2 tokens 59.4 -> 57.9, at 4-16 tokens (32-wide slices) 14-21% slower; gpt-oss-20b's
# one token (4 pairs, 2,880 wide) 79.3 -> 81.1: slower
SMALL_PAIRS = 8
SMALL_MAX_INTER = 1024


def _small_tiles(n_pairs: int, inter: int, qb: int) -> SmallTiles:
    """The small kernel's tiles: 64-column slices, 128 deep, 128 of down's columns a step, 4 warps, 4
    stages (the fastest of the first sweep at one token of Qwen3-30B-A3B, H100: 32.0 us a layer; 0.1 us
    behind the second sweep's fastest; RESULTS.md session 38), within an fp8 block."""
    t = SmallTiles()
    bi = max(16, min(t.block_i, triton.next_power_of_2(inter)))
    if qb:
        bi, bk = min(bi, qb), min(t.block_k, qb)
        return t._replace(block_i=bi, block_k=bk)
    return t._replace(block_i=bi)


def _experts_small(x, w13, w2, b13, b2, scale, rows, experts, n, k, act, tiles, wq13, wq2) -> torch.Tensor:
    """The experts' output [T, H] by _moe_small_kernel's one launch and pair_sum over its slices."""
    T, H = x.shape
    inter = w2.shape[2]
    (ws13, qb), (ws2, _) = (wq13, wq2) if wq13 is not None else ((w13, 0), (w2, 0))
    for w, ws in ((w13, ws13), (w2, ws2)):
        if qb and (ws.shape[1:] != (triton.cdiv(w.shape[1], qb), triton.cdiv(w.shape[2], qb))):
            raise ValueError(f"fp8 scales {tuple(ws.shape)} for {tuple(w.shape[1:])} in {qb}-blocks")
    if qb and (qb % tiles.block_i or qb % tiles.block_k):
        raise ValueError(f"the small kernel's tiles {tiles} must divide the fp8 block {qb}")
    splits = triton.cdiv(inter, tiles.block_i)
    part = torch.empty((splits * n, H), dtype=torch.float32, device=x.device)
    bm = rows.numel() // max(1, experts.numel())
    _moe_small_kernel[(experts.shape[0], splits)](
        x, w13, w2, w13 if b13 is None else b13.contiguous(), w2 if b2 is None else b2.contiguous(), part,
        scale, rows, experts, ws13, ws2, n, H, inter, x.stride(0), ws13.stride(0) if qb else 0,
        ws13.stride(1) if qb else 0, ws2.stride(0) if qb else 0, ws2.stride(1) if qb else 0, act[1], act[2],
        TOP_K=k, ACT=act[0], BIAS_UP=b13 is not None, BIAS_DOWN=b2 is not None, **_dot_args(x.dtype),
        QB=qb, BLOCK_M=bm, BLOCK_I=tiles.block_i, BLOCK_K=tiles.block_k, BLOCK_N=tiles.block_n,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl.launch_args(x),
    )  # fmt: skip
    return pair_sum(part, T, k, splits, dtype=x.dtype)


def _gemm(
    a,
    w,
    bias,
    c,
    scale,
    rows,
    experts,
    n_pairs,
    top_k,
    gather,
    tiles,
    act=(0, 0.0, 0.0),
    wq=None,
    glu_out=False,
) -> None:
    """One launch of the kernel. `wq`: (scales [E, ceil(N / QB), ceil(K / QB)] float32, QB) where w is
    fp8 with block scales, else None. `glu_out`: w is gate/up's [E, 2I, K] and c [pairs, I] takes
    silu(gate) * up (the kernel's GLU_OUT)."""
    N, K = w.shape[1], w.shape[2]
    if tiles.split_k > 1 and (gather or c.shape[0] < tiles.split_k * n_pairs):
        raise ValueError("split-K is for down's GEMM, whose C holds split_k x the pairs' rows")
    if glu_out and (N % 2 or act[0] or tiles.split_k > 1):
        raise ValueError(
            "the silu in gate/up's epilogue takes gate/up's even rows, no other activation, one K run"
        )
    ws, qb = (w, 0) if wq is None else wq
    if qb:
        tiles = tiles._replace(block_k=min(tiles.block_k, qb))
        if qb % tiles.block_k or ws.shape[1:] != (triton.cdiv(N, qb), triton.cdiv(K, qb)):
            raise ValueError(
                f"fp8 scales {tuple(ws.shape)} for [{N}, {K}] in {qb}-blocks (K tile {tiles.block_k})"
            )
    n_out = N // 2 if glu_out else N  # C's columns
    grid = (experts.shape[0], triton.cdiv(n_out, tiles.block_n), tiles.split_k)
    cols_first = bool(tiles.cols_first) and grid[0] <= 65535  # (a grid's second dimension's limit)
    if cols_first:
        grid = (grid[1], grid[0], grid[2])
    _moe_gemm_kernel[grid](
        a, w, w if bias is None else bias.contiguous(), c, scale, rows, experts, ws, n_pairs, n_out, K,
        a.stride(0), c.stride(0), ws.stride(0) if qb else 0, ws.stride(1) if qb else 0, act[1], act[2],
        TOP_K=top_k, ACT=act[0], GATHER=gather, SCALE=scale is not None, BIAS=bias is not None,
        **_dot_args(a.dtype), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        SPLIT_K=tiles.split_k, QB=qb, COLS_FIRST=cols_first, GLU_OUT=glu_out, PRECISE_EXP=PRECISE,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl.launch_args(a),
    )  # fmt: skip


# Steps of more pairs than this take the silu out of down's loads: in gate/up's epilogue (SILU_IN_GATE_UP)
# or else in a pass of its own (one launch) (gpt-oss's clamped SwiGLU stays inside: apart it would be
# several torch ops, not measured). Down reads each pair's gate/up row once per column tile (16 times
# for Qwen3-30B-A3B's 2,048 columns), so inside it the activation's loads and exps are done 16 times
# over. At prefill sizes down ran at 93-122 TFLOP/s against gate/up's 320-372 (RESULTS.md, session 33,
# 4,096 tokens); that this repetition is the cause is inferred (`benchmarks/moe.py --act-apart-above
# 2048,1000000000` compares both in one engine).
ACT_APART_PAIRS = 2048
# Past ACT_APART_PAIRS, gate/up's launch takes the silu in its epilogue (GLU_OUT: it writes silu(gate) * up,
# [pairs, I], the same values as gate/up then silu_and_mul) rather than a pass of its own over [pairs, 2I].
# Qwen3-30B-A3B's prefill of 256 one-prompt steps of 512 tokens (H100, one run each; RESULTS.md session
# 37): 10.69 -> 10.24 s on the 128-row tiles, 13.28 -> 10.05 s on the 64-row ones the rule now takes there.
SILU_IN_GATE_UP = True


def _glu_apart(h: torch.Tensor, glu, inter: int, silu: bool) -> torch.Tensor:
    """glu(gate, up) of gate/up's output h [pairs, 2 * inter], [pairs, inter] contiguous (`silu`: the
    glu is silu(gate) * up, on CUDA in one launch)."""
    from foveal.layers import fused

    if silu and fused.use_fused(h):
        return fused.silu_and_mul(h)
    return glu(h[:, :inter], h[:, inter:]).contiguous()


def _fused_act(glu) -> tuple[int, float, float] | None:
    """The kernel's ACT for the glu the layer uses (its alpha and limit), or None: applied apart."""
    from foveal.layers.moe import ClampedSwiGLU, silu_glu

    if glu is silu_glu:
        return (1, 0.0, 0.0)
    if isinstance(glu, ClampedSwiGLU):
        return (2, float(glu.alpha), float(glu.limit))
    return None


def block_m(n_pairs: int, w13: torch.Tensor, x: torch.Tensor) -> int:
    """The row tile experts_triton's gate/up uses for n_pairs of activations x (their type picks the
    tiles, as in experts_triton: fp8 weights are read in it): what align / route_align must pad runs to;
    down aligns again where its tiles take other rows."""
    return _tiles(n_pairs, w13.shape[0], w13.shape[1], w13.shape[2], False, x.element_size()).block_m


def experts_triton(
    x, w13, w2, weights, ids, glu, b13=None, b2=None, aligned=None, wq13=None, wq2=None
) -> torch.Tensor:
    """The experts' output [T, H] (foveal/layers/moe.py `experts_grouped`'s contract): gate/up by the
    kernel over x's rows (plus b13), the activation `glu(gate, up)` (inside the down kernel's loads for
    the two the kernel knows, up to ACT_APART_PAIRS pairs; past that the silu in gate/up's epilogue,
    SILU_IN_GATE_UP, or in a pass of its own), down by the kernel (plus b2) scaled by each pair's weight,
    summed over each token's k pairs; steps of at most SMALL_PAIRS pairs (glu known, experts at most
    SMALL_MAX_INTER wide) instead in one launch of whole expert MLPs over slices of the intermediate
    (_moe_small_kernel), then pair_sum over the slices' partial sums. `aligned`: (rows, experts) already
    made for ids (route_align), else align() makes them. `wq13`, `wq2`: (scales, block) where w13 / w2
    are fp8 with one float32 scale per block x block (the layout of block-quantized FP8 checkpoints,
    whose `weight_scale_inv` multiplies the stored values), else None: weights in x's type."""
    T, k = ids.shape
    E, two_i, H = w13.shape
    inter = two_i // 2
    assert x.is_contiguous() and w13.is_contiguous() and w2.is_contiguous()
    for w, wq in ((w13, wq13), (w2, wq2)):
        fp8 = w.dtype in FP8_DTYPES
        if fp8 != (wq is not None) or (not fp8 and w.dtype != x.dtype):
            raise ValueError(f"experts' weights {w.dtype} for {x.dtype} activations (scales go with fp8)")
    n = T * k
    size = x.element_size()
    act = _fused_act(glu)
    prefill_silu = act is not None and act[0] == 1 and n > ACT_APART_PAIRS
    glu_out = prefill_silu and SILU_IN_GATE_UP
    apart = act is None or prefill_silu  # unknown, or a prefill's silu: not inside down's loads
    up = _tiles(n, E, two_i, H, False, size, glu_out=glu_out)
    down = _tiles(n, E, H, inter, True, size, fused_act=not apart)
    rows, experts = aligned if aligned is not None else align(ids, E, up.block_m)
    if rows.numel() != experts.numel() * up.block_m:  # (aligned= made for another row tile than block_m()'s)
        raise ValueError(
            f"rows aligned to {rows.numel() // max(1, experts.numel())}-row tiles, gate/up takes {up.block_m}"
        )
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    if act is not None and n <= SMALL_PAIRS and inter <= SMALL_MAX_INTER:
        small = _small_tiles(n, inter, 0 if wq13 is None else wq13[1])
        return _experts_small(x, w13, w2, b13, b2, scale, rows, experts, n, k, act, small, wq13, wq2)
    h = torch.empty((n, inter if glu_out else two_i), dtype=x.dtype, device=x.device)
    _gemm(x, w13, b13, h, None, rows, experts, n, k, True, up, wq=wq13, glu_out=glu_out)
    if down.block_m != up.block_m:  # down's own row tile: the pairs aligned again (device ops only)
        rows, experts = align(ids, E, down.block_m)
    d = torch.empty((down.split_k * n, H), dtype=x.dtype, device=x.device)
    if apart:
        if not glu_out:
            h = _glu_apart(h, glu, inter, act is not None)
        act = (0, 0.0, 0.0)
    _gemm(h, w2, b2, d, scale, rows, experts, n, k, False, down, act, wq2)
    return pair_sum(d, T, k, down.split_k)


@triton.jit
def _pair_sum_kernel(
    d_ptr,
    out_ptr,
    num_pairs,
    H,
    TOP_K: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, cols] = sum over s < SPLITS, j < TOP_K of d[s * num_pairs + t * TOP_K + j, cols], in float32:
    row by row (CHUNK 0), or CHUNK rows a load (the small kernel's dozens of slices: all in flight)."""
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if CHUNK == 0:
        for s in tl.static_range(SPLITS):
            for j in tl.static_range(TOP_K):
                row = s * num_pairs + t * TOP_K + j
                acc += tl.load(d_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        for r0 in tl.static_range(0, SPLITS * TOP_K, CHUNK):
            r = r0 + tl.arange(0, CHUNK)
            row = (r // TOP_K) * num_pairs + t * TOP_K + r % TOP_K
            mask = (r < SPLITS * TOP_K)[:, None] & ok[None, :]
            acc += tl.sum(
                tl.load(d_ptr + row[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32), 0
            )
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def pair_sum(
    d: torch.Tensor, T: int, k: int, splits: int = 1, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """[T, H] (in `dtype`, default d's): each token's k pair rows of down's output d [splits * T * k, H]
    (split-K's partial products, or the small kernel's per slice: `splits` runs of T * k rows) summed in
    float32, in one launch (torch's reduction over the middle dim of [T, k, H] took 4.5 us a layer of
    Qwen3-30B-A3B's batch-1 step: `benchmarks/moe.py --profile`, RESULTS.md session 33). Each token's
    sum is the same whatever else the step holds."""
    H = d.shape[1]
    out = torch.empty((T, H), dtype=dtype or d.dtype, device=d.device)
    block = min(1024, triton.next_power_of_2(max(H // 8, 32)))  # ~8 programs a token
    chunk = 0
    if splits > 4:  # the small kernel's slices: narrower programs (at least ~64), 64 rows a load
        block = min(block, max(32, triton.next_power_of_2(triton.cdiv(H * T, 64))))
        chunk = min(64, triton.next_power_of_2(splits * k))
    if T:
        _pair_sum_kernel[(T, triton.cdiv(H, block))](
            d, out, T * k, H, TOP_K=k, SPLITS=splits, BLOCK=block, CHUNK=chunk, **pdl.launch_args(d)
        )
    return out
