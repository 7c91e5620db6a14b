"""One Triton kernel draws every row's token on CUDA: temperature, min_p, top_k, top_p and the draw,
without sorting the vocabulary and without a host sync.

One program per row streams the row's logits in column blocks:

    pass 1         m = max(y), lo = min(y) over y = x / T       (T == 0: the row is greedy, argmax x)
    min_p          tau = m + log(min_p)                         (keep p >= min_p * p_max)
    top_k          tau_k by bisection on a value t: count(y >= t) >= k; it stops once the count is k
                   (the k largest), or when the interval holds one distinct value (ties: all kept)
    top_p          over S = {y >= max(tau, tau_k)}, Z = sum_S e^(y - m): tau_p by bisection on t with
                   mass(y >= t) >= top_p * Z; it stops when [a, b) holds one data value
    draw           argmax over {y >= tau*} of e^(y - m) / E_j, E_j = -log U(key, j) (sample/noise.py)

So the kept set is a threshold set: a token stays when it is at least as likely as the last one a
sort would keep (ties at the boundary are all kept, where a sort keeps an arbitrary subset of them).
Each bisection step is one pass over the row; the passes run from the L2 cache for a row's second
and later passes where the rows of the programs in flight fit. The kernel also writes each row's
final threshold tau* (tests compare it with the sort-based filter).

Triton is imported at the first call (the CPU path never needs it); under TRITON_INTERPRET=1 the
kernel runs on CPU tensors, which is how it is tested.
"""

from __future__ import annotations

import torch

_BLOCK = 2048
_MAX_STEPS = 64  # bisection steps at most (float32 intervals shrink to adjacent values well before)

_kernel = None
_noise = None


def _triton_kernel():
    global _kernel, _noise, tl, _mix32, _uniform, _count_mass, _bisect  # @triton.jit resolves globals
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def _mix32(h):
        h = h ^ (h >> 16)
        h = h * 0x7FEB352D
        h = h ^ (h >> 15)
        h = h * 0x846CA68B
        return h ^ (h >> 16)

    @triton.jit
    def _uniform(cols, k0, k1):
        """noise.py's uniform of columns `cols` for the key halves (k0, k1): the same bits."""
        h = _mix32(_mix32(cols.to(tl.uint32) ^ k0) ^ k1)
        return ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _fill_kernel(keys_ptr, out_ptr, V, UNIFORM: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
        k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
        u = _uniform(cols, k0, k1)
        if UNIFORM:
            tl.store(out_ptr + row.to(tl.int64) * V + cols, u, mask=cols < V)
        else:
            tl.store(out_ptr + row.to(tl.int64) * V + cols, -tl.log(u), mask=cols < V)

    @triton.jit
    def _count_mass(x_row, V, inv_t, m, t, floor, BLOCK: tl.constexpr):
        """count and mass (sum e^(y - m)) of {y >= t and y >= floor}."""
        cnt = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
            keep = (y >= t) & (y >= floor)
            cnt += keep.to(tl.int32)
            mass += tl.where(keep, tl.exp(y - m), 0.0)
        return tl.sum(cnt, 0), tl.sum(mass, 0)

    @triton.jit
    def _bisect(x_row, V, inv_t, m, floor, a, b, ca, cb, need, stop, BY_MASS: tl.constexpr,
                BLOCK: tl.constexpr, MAX_STEPS: tl.constexpr):  # fmt: skip
        """The largest data value t in [a, b) whose count (BY_MASS: mass) of {y >= t, y >= floor}
        reaches need, given a's does (count ca) and b's does not (cb). Each step halves [a, b); it stops
        when [a, b) holds one distinct value, or once a's count is `stop` (top_k: exactly k)."""
        steps = 0
        while (ca > stop) & (ca - cb > 1) & (steps < MAX_STEPS):
            mid = a + (b - a) * 0.5
            if (mid <= a) | (mid >= b):  # adjacent floats: [a, b) holds tied values only
                steps = MAX_STEPS
            else:
                c, mass = _count_mass(x_row, V, inv_t, m, mid, floor, BLOCK)
                if BY_MASS:
                    reached = mass >= need
                else:
                    reached = c.to(tl.float32) >= need
                if reached:
                    a = mid
                    ca = c
                else:
                    b = mid
                    cb = c
                steps += 1
        return a

    @triton.jit
    def _sample_kernel(
        x_ptr,
        x_stride,
        V,
        temp_ptr,
        min_p_ptr,
        top_k_ptr,
        top_p_ptr,
        keys_ptr,
        out_ptr,
        tau_ptr,
        BLOCK: tl.constexpr,
        MAX_STEPS: tl.constexpr,
    ):
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        temp = tl.load(temp_ptr + row)
        neg_inf = float("-inf")
        if temp == 0.0:  # greedy: the first largest logit
            best = tl.full([BLOCK], neg_inf, tl.float32)
            best_i = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32)
                better = y > best
                best = tl.where(better, y, best)
                best_i = tl.where(better, cols, best_i)
            top = tl.max(best, 0)
            first = tl.min(tl.where(best == top, best_i, V), 0)
            tl.store(out_ptr + row, first.to(tl.int64))
            tl.store(tau_ptr + row, top)
        else:
            inv_t = 1.0 / temp
            hi = tl.full([BLOCK], neg_inf, tl.float32)
            lo = tl.full([BLOCK], float("inf"), tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32) * inv_t
                hi = tl.maximum(hi, y)
                lo = tl.minimum(lo, tl.where(y == neg_inf, float("inf"), y))
            m = tl.max(hi, 0)
            low = tl.min(lo, 0)
            tau = tl.full((), neg_inf, tl.float32)
            min_p = tl.load(min_p_ptr + row)
            if min_p > 0.0:
                tau = m + tl.log(min_p)
            k = tl.load(top_k_ptr + row).to(tl.int32)
            if k > 0:  # a = low: every finite value counts (>= k unless fewer are left)
                ca, _z = _count_mass(x_row, V, inv_t, m, low, neg_inf, BLOCK)
                cb, _z = _count_mass(x_row, V, inv_t, m, m, neg_inf, BLOCK)
                a = low
                if cb >= k:  # ties at the top: they are all kept
                    a = m
                    ca = cb
                a = _bisect(x_row, V, inv_t, m, neg_inf, a, m, ca, cb, k.to(tl.float32), k, False,
                            BLOCK, MAX_STEPS)  # fmt: skip
                tau = tl.maximum(tau, a)
            top_p = tl.load(top_p_ptr + row)
            if top_p < 1.0:
                a = tl.maximum(tau, low)
                ca, z = _count_mass(x_row, V, inv_t, m, a, neg_inf, BLOCK)  # z: the kept set's mass
                need = top_p * z
                cb, mb = _count_mass(x_row, V, inv_t, m, m, neg_inf, BLOCK)
                if mb >= need:  # the most likely value alone reaches top_p
                    a = m
                    ca = cb
                a = _bisect(x_row, V, inv_t, m, tau, a, m, ca, cb, need, 0, True, BLOCK, MAX_STEPS)
                tau = tl.maximum(tau, a)
            k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
            k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
            best = tl.full([BLOCK], -1.0, tl.float32)
            best_i = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32) * inv_t
                u = _uniform(cols, k0, k1)
                score = tl.where((y >= tau) & (cols < V), tl.exp(y - m) / -tl.log(u), -1.0)
                better = score > best
                best = tl.where(better, score, best)
                best_i = tl.where(better, cols, best_i)
            top = tl.max(best, 0)
            first = tl.min(tl.where(best == top, best_i, V), 0)
            tl.store(out_ptr + row, first.to(tl.int64))
            tl.store(tau_ptr + row, tau)

    _kernel, _noise = _sample_kernel, _fill_kernel
    return _kernel


def sample_rows(
    x: torch.Tensor,
    temperature: torch.Tensor,
    min_p: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens int64 [B] and thresholds float32 [B] for logits x [B, >= vocab] (fp32 or bf16, rows
    contiguous); per-row float32 temperature (0: greedy), min_p (0: off), top_p (1: off) and top_k
    (0: off) and the noise keys (int64 [B, 2], noise.key_halves)."""
    B = x.shape[0]
    out = torch.empty(B, dtype=torch.long, device=x.device)
    tau = torch.empty(B, dtype=torch.float32, device=x.device)
    if B:
        _triton_kernel()[(B,)](
            x, x.stride(0), vocab, temperature, min_p, top_k, top_p, keys, out, tau,
            BLOCK=_BLOCK, MAX_STEPS=_MAX_STEPS,
        )  # fmt: skip
    return out, tau


def fill_noise(halves: torch.Tensor, vocab: int, uniform: bool) -> torch.Tensor:
    """float32 [n, vocab]: noise.py's uniforms (or exponentials -log U) for the key halves, in one launch
    (the torch integer ops take ~15 passes over the matrix)."""
    out = torch.empty(halves.shape[0], vocab, dtype=torch.float32, device=halves.device)
    if out.numel():
        _triton_kernel()
        _noise[(halves.shape[0], -(-vocab // _BLOCK))](
            halves.contiguous(), out, vocab, UNIFORM=uniform, BLOCK=_BLOCK
        )
    return out
