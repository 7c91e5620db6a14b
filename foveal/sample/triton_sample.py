"""Triton kernels for CUDA's sampling: one program per row draws the row's token (temperature, min_p,
top_k, top_p, the draw) in a few passes over its logits, with no sort and no host sync; a second mode
gives each row's kept-set threshold instead (Sampler.filter); and the noise fill of sample/noise.py.

A row's kept set is a threshold set {y >= tau*}, y = x / T: a token stays when it is at least as likely
as the last one a sort would keep (ties at a boundary all stay, where a sort keeps an arbitrary subset).
The draw is the exponential race in log form, argmax over the kept set of y - log E_j with E_j =
-log U(key, j) (sample/noise.py: Gumbel-max, token j wins with probability softmax(y)_j on the set).

    pass 1     m = max(y); with top_k, top_p or min_p, each lane's 4 largest y and their columns (lane
               c: the columns c, c + LANES, ...; LANES is the block unless set apart)
    min_p      floor = m + log(min_p)                        (keep p >= min_p * p_max)
    top_k      floor = max(floor, the k-th largest y): the k-th largest of the 4 * LANES lane
               candidates, its order-preserving key found a bit a count, in registers (no pass). It is
               the row's k-th largest when no lane's 4th largest exceeds it (a lane can then hold no
               uncounted value above it): so unless one lane holds 4 values above the k-th (for k = 50
               and 4,096 lanes, by chance C(49, 4) / 4096^3: ~3 rows in a million), else radix select
               over the row, a byte a pass (4 passes; ties at the k-th all stay either way)
    draw       the race winner w over {y >= floor}, and Z = sum_{y >= floor} e^(y - m): over the lanes'
               candidates in registers when they hold that whole set (top_k's rows, with their
               columns kept beside them); top_p alone (the set is the row) inside pass 1, Z summed
               per lane against the lane's running maximum; else a pass
    top_p      accept w when the mass above it is below top_p * Z (then w is in the top_p set, and the
               race over that set has the same winner, the set being inside the one raced over); else
               the set shrinks to {y > y_w} and its race's winner is the next w. A round's pass sums
               the mass alone (an exp a value, no noise); only a round that rejects w (at most 1 -
               top_p of them) races the set in a second pass. Each round accepts with probability >=
               top_p; an LLM's peaked rows take one or two (a round whose set the candidates hold runs
               in registers).

So a row costs 1 pass (top_k, min_p: the draw in registers when the candidates hold its set; top_p alone:
the first race in pass 1; temperature alone: the race, which needs no m), 2 where they do not, plus one
per top_p round they cannot hold, where the bisection this replaced took ~30 per filter. The threshold
mode finds top_p's tau by bisection on the mass (`_bisect`: a pass a step; only filter() pays it). Triton
is imported at the first call (the CPU never needs it); under TRITON_INTERPRET=1 the kernels run on CPU
tensors, which is how they are tested.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# One program a row over column blocks of _BLOCK, 16 warps, with _LANES lanes of 4 candidates each. The
# tiles sweeps of benchmarks/sampling.py on an H100 ([256, 128256] mixed rows, RESULTS.md sessions 28-32):
# 4096 x 16 best of 1024-8192 x 4-16 (session 28, fp32 logits). On the decode step's case (bf16 logits,
# the rows' penalties, heavy rows first; session 32, with the seen bits since reverted) 2,048 lanes took
# 0.438 ms against 0.515 with the lanes = the block (4,096 lanes: 8 a thread, 64 registers of candidates,
# which spill) and 0.46-0.55 for the other shapes tried (the bool prompt marks at 2,048 lanes: 0.448-0.473);
# without penalties 0.301 against 0.498 (at 4,096 lanes ptxas gives that bf16 kernel 64 registers and 2 KB
# of spills: benchmarks/kernel_spills.py)
_BLOCK = 4096
_WARPS = 16  # per program (one program a row)
# the lanes of top_k's and the draws' candidates (pass 1 loads this many columns a step); 0: _BLOCK
_LANES = 2048
_MAXNREG = 0  # registers a thread at most (0: Triton's choice: all 128 at 16 warps, one program an SM)
_MAX_STEPS = 64  # top_p bisection steps at most (float32 intervals shrink to adjacent values well before)

# logprobs: the top alternatives row_logprobs finds itself (more: the caller's torch.topk), over this many
# lanes of TOP_SLOTS candidates each
TOP_SLOTS = 8
_TOP_LANES = 512
# a row's parts (a program each: 64 asked rows of 128,256 make 512 programs, not 64 long ones), the
# lanes of the parts without the top ones, and the warps of a part's program: 8 x 8 measured best of
# {8, 16, 32} x {4, 8, 16} on an H100 (64 bf16 rows of 128,256, 5 alternatives: 0.107-0.109 ms; one
# program a row took 0.22-0.23 on the same rows in fp32; RESULTS.md, session 31)
_LSE_PARTS = 8
_LSE_LANES = 1024
_LSE_WARPS = 8

_kernel = _noise = _penalty = _lse = None


def _triton_kernel():
    global _kernel, _noise, _penalty, _lse, tl  # @triton.jit resolves the helpers below as module globals
    global _mix32, _uniform, _key, _unkey, _kth_largest, _race, _count_mass, _bisect, _insert4, _radix_byte
    global _kth_of_lanes, _lanes_hold, _race_one, _race_lanes, _load_x
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
    def _key(y):
        """uint32 keys in y's order (-0.0 as +0.0): the sign bit flipped for y >= 0, all bits for y < 0."""
        b = tl.where(y == 0.0, 0.0, y).to(tl.uint32, bitcast=True)
        return tl.where((b >> 31) != 0, ~b, b | 0x80000000)

    @triton.jit
    def _unkey(k):
        b = tl.where((k >> 31) != 0, k & 0x7FFFFFFF, ~k)
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _load_x(x_row, cols, ok, c_row, p_row, pen, rep, freq, pres, PENALTY: tl.constexpr):
        """The row's logits at cols as float32 (-inf where not ok), with its penalties applied when
        `pen` (PENALTY: some row has them): _penalty_kernel's formula on the same values."""
        x = tl.load(x_row + cols, mask=ok, other=float("-inf")).to(tl.float32)
        if PENALTY:
            if pen:
                c = tl.load(c_row + cols, mask=ok, other=0)
                seen = (tl.load(p_row + cols, mask=ok, other=0) != 0) | (c > 0)
                x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
                x = x - (freq * c.to(tl.float32) + pres * (c > 0).to(tl.float32))
        return x

    @triton.jit
    def _radix_byte(hist, need, prefix):
        """One radix-select step: the byte b of the need-th largest key (the largest b with count(byte
        >= b) >= need) from this byte's histogram; (need among the keys with that byte, prefix + b)."""
        bins = tl.arange(0, 256)
        ge = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        b = tl.sum((ge >= need).to(tl.int32), 0) - 1
        need -= tl.sum(tl.where(bins > b, hist, 0), 0)
        return need, (prefix << 8) | b.to(tl.uint32)

    @triton.jit
    def _kth_largest(x_row, V, inv_t, k, c_row, p_row, pen, rep, freq, pres, PENALTY: tl.constexpr,
                     BLOCK: tl.constexpr):  # fmt: skip
        """The k-th largest finite y, counting ties: radix select on _key(y), a byte a pass; -inf when k
        reaches the finite count (every finite value stays)."""
        need = k
        prefix = tl.full((), 0, tl.uint32)
        stays = False
        for d in tl.static_range(4):
            hist = tl.zeros([256], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _load_x(x_row, cols, cols < V, c_row, p_row, pen, rep, freq, pres, PENALTY) * inv_t
                key = _key(y)
                ok = y > float("-inf")
                if d > 0:
                    ok = ok & ((key >> (32 - 8 * d)) == prefix)
                hist += tl.histogram(((key >> (24 - 8 * d)) & 255).to(tl.int32), 256, mask=ok)
            if d == 0:
                stays = k >= tl.sum(hist, 0)  # the first byte's histogram counts every finite value
            need, prefix = _radix_byte(hist, need, prefix)
        return tl.where(stays, float("-inf"), _unkey(prefix))

    @triton.jit
    def _insert4(c0, c1, c2, c3, j0, j1, j2, j3, y, col):
        """Each lane's 4 largest so far (c0 >= c1 >= c2 >= c3, at columns j0..j3) with y at col added."""
        t = y > c0
        c0, y, j0, col = tl.where(t, y, c0), tl.where(t, c0, y), tl.where(t, col, j0), tl.where(t, j0, col)
        t = y > c1
        c1, y, j1, col = tl.where(t, y, c1), tl.where(t, c1, y), tl.where(t, col, j1), tl.where(t, j1, col)
        t = y > c2
        c2, y, j2, col = tl.where(t, y, c2), tl.where(t, c2, y), tl.where(t, col, j2), tl.where(t, j2, col)
        t = y > c3
        return c0, c1, c2, tl.where(t, y, c3), j0, j1, j2, tl.where(t, col, j3)

    @triton.jit
    def _lanes_hold(c3, lo, strict):
        """Whether the lanes' candidates hold every finite value of {y >= lo} ({y > lo} when strict): each
        lane's uncounted values are <= its 4th largest (or it has fewer than 4)."""
        full = c3 > float("-inf")
        ok = (c3 < lo) | ((c3 == lo) & (strict != 0)) | (~full)
        return tl.min(ok.to(tl.int32), 0) == 1

    @triton.jit
    def _race_one(c, j, m, lo, strict, k0, k1):
        keep = ((c > lo) | ((c == lo) & (strict == 0))) & (c > float("-inf"))
        mass = tl.sum(tl.where(keep, tl.exp(c - m), 0.0), 0)
        return tl.where(keep, c - tl.log(-tl.log(_uniform(j, k0, k1))), float("-inf")), mass

    @triton.jit
    def _race_lanes(c0, c1, c2, c3, j0, j1, j2, j3, m, lo, strict, k0, k1, V):
        """_race over the lanes' candidates, in registers (valid when _lanes_hold): the same winner (the
        first column of the largest y - log E, the noise keyed by column) and the set's mass."""
        s0, z0 = _race_one(c0, j0, m, lo, strict, k0, k1)
        s1, z1 = _race_one(c1, j1, m, lo, strict, k0, k1)
        s2, z2 = _race_one(c2, j2, m, lo, strict, k0, k1)
        s3, z3 = _race_one(c3, j3, m, lo, strict, k0, k1)
        top = tl.maximum(tl.maximum(tl.max(s0, 0), tl.max(s1, 0)), tl.maximum(tl.max(s2, 0), tl.max(s3, 0)))
        w0 = tl.minimum(tl.min(tl.where(s0 == top, j0, V), 0), tl.min(tl.where(s1 == top, j1, V), 0))
        w1 = tl.minimum(tl.min(tl.where(s2 == top, j2, V), 0), tl.min(tl.where(s3 == top, j3, V), 0))
        return tl.minimum(w0, w1), z0 + z1 + z2 + z3

    @triton.jit
    def _kth_of_lanes(c0, c1, c2, c3, k):
        """The k-th largest finite value among the lanes' candidates, counting ties (k <= their finite
        count): its order-preserving key bit by bit from the top, each bit kept when at least k keys
        reach the prefix with it set (32 counts over registers; -inf keys sit below every finite one)."""
        k0, k1, k2, k3 = _key(c0), _key(c1), _key(c2), _key(c3)
        prefix = tl.full((), 0, tl.uint32)
        for bit in tl.static_range(32):
            cand = prefix | (tl.full((), 1, tl.uint32) << (31 - bit))  # unsigned throughout
            n = (k0 >= cand).to(tl.int32) + (k1 >= cand).to(tl.int32)
            n += (k2 >= cand).to(tl.int32) + (k3 >= cand).to(tl.int32)
            if tl.sum(n, 0) >= k:
                prefix = cand
        return _unkey(prefix)

    @triton.jit
    def _race(x_row, V, inv_t, m, lo, strict, k0, k1, c_row, p_row, pen, rep, freq, pres,
              PENALTY: tl.constexpr, BLOCK: tl.constexpr, RACE: tl.constexpr = True):  # fmt: skip
        """(the race winner, Z) over the set {y >= lo} (strict: {y > lo}): the first column with the
        largest y - log E, and sum e^(y - m) over the set. RACE False: Z alone (no noise; the winner
        returned means nothing), the same sum as the race's."""
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], dtype=tl.int32)
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = _load_x(x_row, cols, cols < V, c_row, p_row, pen, rep, freq, pres, PENALTY) * inv_t
            keep = (y > lo) | ((y == lo) & (strict == 0))
            mass += tl.where(keep, tl.exp(y - m), 0.0)
            if RACE:
                score = tl.where(keep, y - tl.log(-tl.log(_uniform(cols, k0, k1))), float("-inf"))
                better = score > best
                best = tl.where(better, score, best)
                best_i = tl.where(better, cols, best_i)
        top = tl.max(best, 0)
        return tl.min(tl.where(best == top, best_i, V), 0), tl.sum(mass, 0)

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
    def _bisect(x_row, V, inv_t, m, floor, a, b, ca, cb, need, BLOCK: tl.constexpr, MAX_STEPS: tl.constexpr):
        """The largest data value t in [a, b) whose mass of {y >= t, y >= floor} reaches need, given a's
        does (count ca) and b's does not (count cb). Each step halves [a, b); it stops when [a, b)
        holds one distinct value."""
        steps = 0
        while (ca - cb > 1) & (steps < MAX_STEPS):
            mid = a + (b - a) * 0.5
            if (mid <= a) | (mid >= b):  # adjacent floats: [a, b) holds tied values only
                steps = MAX_STEPS
            else:
                c, mass = _count_mass(x_row, V, inv_t, m, mid, floor, BLOCK)
                if mass >= need:
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
        slots_ptr,
        pvals_ptr,
        counts_ptr,
        prompt_ptr,
        order_ptr,
        THRESH: tl.constexpr,
        PENALTY: tl.constexpr,
        ORDER: tl.constexpr,
        BLOCK: tl.constexpr,
        LANES: tl.constexpr,
        MAX_STEPS: tl.constexpr,
    ):
        """THRESH: each row's threshold tau* into out (float32); else its token (int64). PENALTY: rows
        with a slot >= 0 read their penalties' counts there (the device history) as they load. ORDER:
        program i draws row order[i] (float32, exact), the heavy rows first (row_order)."""
        row = tl.program_id(0)
        if ORDER:
            row = tl.load(order_ptr + row).to(tl.int32)
        x_row = x_ptr + row.to(tl.int64) * x_stride
        temp = tl.load(temp_ptr + row)
        neg_inf = float("-inf")
        if PENALTY:
            slot = tl.load(slots_ptr + row).to(tl.int64)
            pen = slot >= 0
            c_row = counts_ptr + tl.maximum(slot, 0) * V
            p_row = prompt_ptr + tl.maximum(slot, 0) * V
            B = tl.num_programs(0)
            rep = tl.load(pvals_ptr + row)
            freq = tl.load(pvals_ptr + B + row)
            pres = tl.load(pvals_ptr + 2 * B + row)
        else:
            pen, c_row, p_row, rep, freq, pres = False, counts_ptr, prompt_ptr, 1.0, 0.0, 0.0
        if temp == 0.0:  # greedy: the first largest logit
            best = tl.full([BLOCK], neg_inf, tl.float32)
            best_i = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = _load_x(x_row, cols, cols < V, c_row, p_row, pen, rep, freq, pres, PENALTY)
                better = y > best
                best = tl.where(better, y, best)
                best_i = tl.where(better, cols, best_i)
            top = tl.max(best, 0)
            if THRESH:
                tl.store(out_ptr + row, top)
            else:
                tl.store(out_ptr + row, tl.min(tl.where(best == top, best_i, V), 0).to(tl.int64))
        else:
            inv_t = 1.0 / temp
            k = tl.load(top_k_ptr + row).to(tl.int32)
            c0 = tl.full([LANES], neg_inf, tl.float32)  # each lane's 4 largest (c0: its maximum)
            c1 = tl.full([LANES], neg_inf, tl.float32)
            c2 = tl.full([LANES], neg_inf, tl.float32)
            c3 = tl.full([LANES], neg_inf, tl.float32)
            j0 = tl.zeros([LANES], dtype=tl.int32)  # their columns
            j1 = tl.zeros([LANES], dtype=tl.int32)
            j2 = tl.zeros([LANES], dtype=tl.int32)
            j3 = tl.zeros([LANES], dtype=tl.int32)
            top_p = tl.load(top_p_ptr + row)
            min_p = tl.load(min_p_ptr + row)
            # the candidates serve top_k and the draws (min_p's set, top_p's rounds: held when small)
            lanes = (k > 0) | (((top_p < 1.0) | (min_p > 0.0)) & (not THRESH))
            # pass 1: the maximum, lo_min the smallest finite y (where the threshold mode's bisection
            # starts); with lanes, their candidates too, LANES columns a step (names apart per branch:
            # Triton unifies what both branches define, and the shapes differ)
            # top_p alone (no top_k, no min_p: the first race's set is the whole row): that race rides
            # pass 1 (each lane's winner, and its mass rescaled to the lane's running maximum)
            fused = (top_p < 1.0) & (k == 0) & (min_p == 0.0) & (not THRESH)
            if THRESH:  # no noise read: keys_ptr is a stand-in of B values, not [B, 2]
                k0 = tl.full((), 0, tl.uint32)
                k1 = tl.full((), 0, tl.uint32)
            else:
                k0 = tl.load(keys_ptr + row * 2).to(tl.uint32)
                k1 = tl.load(keys_ptr + row * 2 + 1).to(tl.uint32)
            w_f = 0
            z_f = 0.0
            if lanes:
                lo_l = tl.full([LANES], float("inf"), tl.float32)
                best_l = tl.full([LANES], neg_inf, tl.float32)
                best_j = tl.zeros([LANES], dtype=tl.int32)
                mass_l = tl.zeros([LANES], dtype=tl.float32)
                for start in range(0, V, LANES):
                    col_l = start + tl.arange(0, LANES)
                    yl = _load_x(x_row, col_l, col_l < V, c_row, p_row, pen, rep, freq, pres, PENALTY) * inv_t
                    was = c0  # the lanes' maxima before this block (the fused race's rescale)
                    c0, c1, c2, c3, j0, j1, j2, j3 = _insert4(c0, c1, c2, c3, j0, j1, j2, j3, yl, col_l)
                    if THRESH:
                        lo_l = tl.minimum(lo_l, tl.where(yl == neg_inf, float("inf"), yl))
                    if fused:
                        live = yl > neg_inf
                        score = tl.where(live, yl - tl.log(-tl.log(_uniform(col_l, k0, k1))), neg_inf)
                        better = score > best_l
                        best_l = tl.where(better, score, best_l)
                        best_j = tl.where(better, col_l, best_j)
                        kept = tl.where(was == neg_inf, 0.0, mass_l * tl.exp(was - c0))
                        mass_l = kept + tl.where(live, tl.exp(yl - c0), 0.0)
                m = tl.max(c0, 0)
                lo_min = tl.min(lo_l, 0)
                if fused:
                    top_s = tl.max(best_l, 0)
                    w_f = tl.min(tl.where(best_l == top_s, best_j, V), 0)
                    z_f = tl.sum(tl.where(c0 == neg_inf, 0.0, mass_l * tl.exp(c0 - m)), 0)
            elif (min_p > 0.0) | (top_p < 1.0):
                top_b = tl.full([BLOCK], neg_inf, tl.float32)
                lo_b = tl.full([BLOCK], float("inf"), tl.float32)
                for start in range(0, V, BLOCK):
                    col_b = start + tl.arange(0, BLOCK)
                    yb = _load_x(x_row, col_b, col_b < V, c_row, p_row, pen, rep, freq, pres, PENALTY) * inv_t
                    top_b = tl.maximum(top_b, yb)
                    if THRESH:
                        lo_b = tl.minimum(lo_b, tl.where(yb == neg_inf, float("inf"), yb))
                m = tl.max(top_b, 0)
                lo_min = tl.min(lo_b, 0)
            else:  # temperature alone: the race needs no maximum (its mass goes unused), so no pass 1
                m = tl.full((), 0.0, tl.float32)
                lo_min = m
            floor = tl.full((), neg_inf, tl.float32)
            if min_p > 0.0:
                floor = m + tl.log(min_p)
            if k > 0:
                held = (c0 > neg_inf).to(tl.int32) + (c1 > neg_inf).to(tl.int32)
                held = tl.sum(held + (c2 > neg_inf).to(tl.int32) + (c3 > neg_inf).to(tl.int32), 0)
                full = tl.max(c3, 0) > neg_inf  # some lane may have more finite values than it holds
                if (k < held) | full:  # else the candidates are every finite value, <= k: all stay
                    kth = neg_inf
                    exact = k <= held
                    if exact:
                        kth = _kth_of_lanes(c0, c1, c2, c3, k)
                        exact = tl.max(c3, 0) <= kth  # no lane hides a value above it
                    if not exact:
                        kth = _kth_largest(x_row, V, inv_t, k, c_row, p_row, pen, rep, freq, pres, PENALTY,
                                           BLOCK)  # fmt: skip
                    floor = tl.maximum(floor, kth)
            if THRESH:
                if top_p < 1.0:
                    a = tl.maximum(floor, lo_min)
                    ca, z = _count_mass(x_row, V, inv_t, m, a, neg_inf, BLOCK)  # z: the kept set's mass
                    need = top_p * z
                    cb, mb = _count_mass(x_row, V, inv_t, m, m, neg_inf, BLOCK)
                    if mb >= need:  # the most likely value alone reaches top_p
                        a = m
                        ca = cb
                    floor = tl.maximum(floor, _bisect(x_row, V, inv_t, m, floor, a, m, ca, cb, need,
                                                      BLOCK, MAX_STEPS))  # fmt: skip
                tl.store(out_ptr + row, floor)
            else:
                # each race in registers when the lanes' candidates hold its whole set (top_k's, a late
                # top_p round's), else a pass over the row (top_p alone: pass 1 ran the first)
                if fused:
                    w, z = w_f, z_f
                elif lanes & _lanes_hold(c3, floor, 0):
                    w, z = _race_lanes(c0, c1, c2, c3, j0, j1, j2, j3, m, floor, 0, k0, k1, V)
                else:
                    w, z = _race(x_row, V, inv_t, m, floor, 0, k0, k1, c_row, p_row, pen, rep, freq, pres,
                                 PENALTY, BLOCK)  # fmt: skip
                if top_p < 1.0:
                    need = top_p * z
                    above = need
                    while above >= need:  # w is in the top_p set iff the mass above it is < need
                        wy = _load_x(x_row, w, w < V, c_row, p_row, pen, rep, freq, pres, PENALTY) * inv_t
                        if _lanes_hold(c3, wy, 1):
                            w2, above = _race_lanes(c0, c1, c2, c3, j0, j1, j2, j3, m, wy, 1, k0, k1, V)
                        else:  # the mass above w first (an exp a value); the race (its noise) only when
                            # w is out, at most 1 - top_p of the time
                            w2, above = _race(x_row, V, inv_t, m, wy, 1, k0, k1, c_row, p_row, pen, rep, freq,
                                              pres, PENALTY, BLOCK, False)  # fmt: skip
                            if above >= need:
                                w2, above = _race(x_row, V, inv_t, m, wy, 1, k0, k1, c_row, p_row, pen, rep,
                                                  freq, pres, PENALTY, BLOCK)  # fmt: skip
                        if above >= need:
                            w = w2
                tl.store(out_ptr + row, w.to(tl.int64))

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
    def _penalty_kernel(x_ptr, x_stride, rows_ptr, slots_ptr, vals_ptr, counts_ptr, prompt_ptr, V,
                        BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < V
        at = x_ptr + tl.load(rows_ptr + i) * x_stride + cols
        slot = tl.load(slots_ptr + i) * V
        rep = tl.load(vals_ptr + i * 3)
        freq = tl.load(vals_ptr + i * 3 + 1)
        pres = tl.load(vals_ptr + i * 3 + 2)
        x = tl.load(at, mask=ok)
        c = tl.load(counts_ptr + slot + cols, mask=ok, other=0)
        seen = (tl.load(prompt_ptr + slot + cols, mask=ok, other=0) != 0) | (c > 0)
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - (freq * c.to(tl.float32) + pres * (c > 0).to(tl.float32))
        tl.store(at, x, mask=ok)

    @triton.jit
    def _lse_part_kernel(x_ptr, x_stride, rows_ptr, part_ptr, cols_ptr, V, CHUNK, K, BLOCK: tl.constexpr,
                         TOP: tl.constexpr, SLOTS: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        """Part s of row rows[i]: columns [s * CHUNK, (s + 1) * CHUNK) in one pass (each lane's running
        max and sum); part[i, s] = [max, sum of e^(x - max), its SLOTS largest (-inf past K)] and cols[i,
        s] their columns. TOP: the lanes' maxima are distinct values of the part, so its K largest are
        at least the K-th largest of them (t): a second pass keeps, per lane, the SLOTS largest values
        >= t (the blocks holding none, nearly all, skip the update), then K rounds take the largest
        left (ties: the smaller column first)."""
        i = tl.program_id(0)
        s = tl.program_id(1)
        row = tl.load(rows_ptr + i)
        x_row = x_ptr + row * x_stride
        lo = s * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        neg_inf = float("-inf")
        m = tl.full([BLOCK], neg_inf, tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            y = tl.load(x_row + cols, mask=cols < hi, other=neg_inf).to(tl.float32)
            m_new = tl.maximum(m, y)
            kept = tl.where(m == neg_inf, 0.0, acc * tl.exp(m - m_new))  # the lane's sum so far, rescaled
            acc = kept + tl.where(y == neg_inf, 0.0, tl.exp(y - m_new))
            m = m_new
        top = tl.max(m, 0)
        total = tl.sum(tl.where(m == neg_inf, 0.0, acc * tl.exp(m - top)), 0)
        at = part_ptr + (i * PARTS + s) * (2 + SLOTS)
        tl.store(at, top)
        tl.store(at + 1, total)
        if TOP:
            lane = tl.arange(0, BLOCK)
            t = top
            left = m
            for r in tl.static_range(SLOTS):  # t: the K-th largest lane maximum
                if r < K:
                    t = tl.max(left, 0)
                    left = tl.where(lane == tl.min(tl.where(left == t, lane, BLOCK), 0), neg_inf, left)
            cand = tl.full([BLOCK, SLOTS], neg_inf, tl.float32)
            cidx = tl.zeros([BLOCK, SLOTS], dtype=tl.int32)
            slot = tl.arange(0, SLOTS)
            for start in range(lo, hi, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                y = tl.load(x_row + cols, mask=cols < hi, other=neg_inf).to(tl.float32)
                if tl.max((y >= t).to(tl.int32), 0) > 0:  # y replaces its lane's smallest kept when larger
                    hit = (slot[None, :] == tl.argmin(cand, 1)[:, None]) & (y > tl.min(cand, 1))[:, None]
                    hit = hit & (y >= t)[:, None]
                    cand = tl.where(hit, y[:, None], cand)
                    cidx = tl.where(hit, cols[:, None], cidx)
            c_at = cols_ptr + (i * PARTS + s) * SLOTS
            for r in tl.static_range(SLOTS):
                v = neg_inf
                col = 0
                if r < K:
                    v = tl.max(tl.max(cand, 1), 0)
                    col = tl.min(tl.min(tl.where(cand == v, cidx, V), 1), 0)
                    cand = tl.where((cand == v) & (cidx == col), neg_inf, cand)
                tl.store(at + 2 + r, v)
                tl.store(c_at + r, col)

    @triton.jit
    def _lse_kernel(x_ptr, x_stride, rows_ptr, tokens_ptr, part_ptr, cols_ptr, out_ptr, pack_ptr, V, K,
                    TOP: tl.constexpr, SLOTS: tl.constexpr, PARTS: tl.constexpr):  # fmt: skip
        """Row rows[i] from its parts (_lse_part_kernel): out[i] = (its log-sum-exp, its drawn token's
        logit minus it). TOP: also pack row i = [token, logprob, the K (<= SLOTS) largest logits minus
        lse, their columns] (float64), the parts' largest merged (ties: the smaller column first)."""
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i)
        neg_inf = float("-inf")
        part = tl.arange(0, PARTS)
        at = part_ptr + i * PARTS * (2 + SLOTS) + part * (2 + SLOTS)
        m = tl.load(at)
        acc = tl.load(at + 1)
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(tl.where(m == neg_inf, 0.0, acc * tl.exp(m - top)), 0))
        tok = tl.load(tokens_ptr + row)
        chosen = tl.load(x_ptr + row * x_stride + tok).to(tl.float32) - lse
        tl.store(out_ptr + i * 2, lse)
        tl.store(out_ptr + i * 2 + 1, chosen)
        if TOP:
            slot = tl.arange(0, SLOTS)
            cand = tl.load(at[:, None] + 2 + slot[None, :])
            cidx = tl.load(cols_ptr + (i * PARTS + part)[:, None] * SLOTS + slot[None, :])
            out = pack_ptr + i * (2 + 2 * K)
            tl.store(out, tok.to(tl.float64))
            tl.store(out + 1, chosen.to(tl.float64))
            for r in tl.static_range(SLOTS):
                if r < K:
                    v = tl.max(tl.max(cand, 1), 0)
                    col = tl.min(tl.min(tl.where(cand == v, cidx, V), 1), 0)
                    tl.store(out + 2 + r, (v - lse).to(tl.float64))
                    tl.store(out + 2 + K + r, col.to(tl.float64))
                    cand = tl.where((cand == v) & (cidx == col), neg_inf, cand)

    _kernel, _noise, _penalty = _sample_kernel, _fill_kernel, _penalty_kernel
    _lse = (_lse_part_kernel, _lse_kernel)
    return _kernel


def row_order(
    temperature: Sequence[float], min_p: Sequence[float], top_k: Sequence[float], top_p: Sequence[float]
):
    """The rows' indices, those the kernel spends longest on first (None: all alike, any order). The
    GPU starts programs in order as earlier ones end, so the last to start should be short, not a
    top_p row's several passes (the costs: top_p without top_k > min_p > one pass > greedy)."""
    columns = (temperature, min_p, top_k, top_p)
    if all(c.count(c[0]) == len(c) for c in columns if c):  # one mix (nano-vllm's rows): no loop per row
        return None
    buckets: tuple[list[int], ...] = ([], [], [], [])
    for i, (t, mp, k, p) in enumerate(zip(*columns)):
        cost = 0 if t == 0 else 1 if k > 0 else 3 if p < 1 else 2 if mp > 0 else 1
        buckets[3 - cost].append(i)
    if max(len(b) for b in buckets) == len(temperature):
        return None
    return buckets[0] + buckets[1] + buckets[2] + buckets[3]


def _launch(x, temperature, min_p, top_k, top_p, keys, vocab: int, thresh: bool, penalties=None, order=None):
    B = x.shape[0]
    out = torch.empty(B, dtype=torch.float32 if thresh else torch.long, device=x.device)
    if B:
        slots, vals, counts, prompt = penalties if penalties is not None else (keys, temperature, keys, keys)
        if penalties is not None:
            vals, prompt = vals.contiguous(), prompt.view(torch.uint8)
        _triton_kernel()[(B,)](
            x, x.stride(0), vocab, temperature, min_p, top_k, top_p, keys, out, slots, vals, counts, prompt,
            keys if order is None else order, THRESH=thresh, PENALTY=penalties is not None,
            ORDER=order is not None, BLOCK=_BLOCK, LANES=_LANES or _BLOCK,
            MAX_STEPS=_MAX_STEPS, num_warps=_WARPS, **({"maxnreg": _MAXNREG} if _MAXNREG else {}),
        )  # fmt: skip
    return out


def sample_rows(x, temperature, min_p, top_k, top_p, keys, vocab: int, penalties=None, order=None):
    """Tokens int64 [B] for logits x [B, >= vocab] (fp32 or bf16, rows contiguous); per-row float32
    temperature (0: greedy), min_p (0: off), top_k (0: off), top_p (1: off) and the noise keys (int64
    [B, 2], noise.key_halves). penalties: None, or (the rows' history slots [B], -1 for a row without,
    int64 or float32 (exact below 2**24); their repetition, frequency and presence penalties float32
    [3, B]; the device history's counts int32 [slots, vocab] and prompt marks bool [slots, vocab]):
    applied as the rows load (penalize()'s values, no copy). order: None, or float32 [B] (exact), the
    rows in the order their programs take them (row_order's): the same tokens, sooner."""
    return _launch(x, temperature, min_p, top_k, top_p, keys, vocab, False, penalties, order)


def thresholds(x, temperature, min_p, top_k, top_p, vocab: int) -> torch.Tensor:
    """float32 [B]: each row's tau*, its kept set being {x / T >= tau*} (greedy rows: their maximum)."""
    no_keys = top_k  # the threshold mode reads no noise: any tensor stands in for the keys
    return _launch(x, temperature, min_p, top_k, top_p, no_keys, vocab, thresh=True)


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


def row_logprobs(x, rows, tokens, k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """For each of `rows` (int64 [n]) of logits x [B, >= V] (fp32 or bf16, rows contiguous; V =
    x.shape[1]: pass the vocabulary's columns), one pass over the row in _LSE_PARTS parts (programs of
    their own), no copy of it: (float32 [n, 2]: its log-sum-exp and the logprob of its token in `tokens`
    (int64 [B]); with 0 < k <= TOP_SLOTS, the Sampler's logprobs pack float64 [n, 2 + 2k]: token,
    logprob, the k largest logits' logprobs and their columns, else None: the caller finds those)."""
    n, top, V = rows.numel(), 0 < k <= TOP_SLOTS, x.shape[1]
    out = torch.empty(n, 2, dtype=torch.float32, device=x.device)
    pack = torch.empty(n, 2 + 2 * k, dtype=torch.float64, device=x.device) if top else None
    if n:
        _triton_kernel()
        lanes = _TOP_LANES if top else _LSE_LANES
        chunk = -(-V // _LSE_PARTS)
        chunk = max(lanes, -(-chunk // lanes) * lanes)  # whole blocks; parts past V hold nothing
        part = torch.empty(n, _LSE_PARTS, 2 + TOP_SLOTS, dtype=torch.float32, device=x.device)
        cols = torch.empty(n, _LSE_PARTS, TOP_SLOTS, dtype=torch.int32, device=x.device) if top else part
        _lse[0][(n, _LSE_PARTS)](
            x, x.stride(0), rows, part, cols, V, chunk, k,
            BLOCK=lanes, TOP=top, SLOTS=TOP_SLOTS, PARTS=_LSE_PARTS, num_warps=_LSE_WARPS,
        )  # fmt: skip
        _lse[1][(n,)](
            x, x.stride(0), rows, tokens, part, cols, out, out if pack is None else pack, V, k,
            TOP=top, SLOTS=TOP_SLOTS, PARTS=_LSE_PARTS, num_warps=1,
        )  # fmt: skip
    return out, pack


def penalize(x, rows, slots, vals, counts, prompt) -> torch.Tensor:
    """The penalties in place, one pass: x [B, V] float32 rows `rows` (int64 [n]) with the device
    history's counts int32 [slots, V] and prompt marks bool [slots, V] of `slots` (int64 [n]) and per
    row (repetition, frequency, presence) in vals float32 [n, 3] (Sampler._apply_penalties' formula)."""
    V = x.shape[1]
    if rows.numel():
        _triton_kernel()
        _penalty[(rows.numel(), -(-V // _BLOCK))](
            x, x.stride(0), rows, slots, vals.contiguous(), counts, prompt.view(torch.uint8), V, BLOCK=_BLOCK
        )
    return x
