"""Decode rows that share a prefix of cached blocks attend to it once per tile of rows, not once per row.

With prefix caching, requests with the same system prompt (or few-shot examples, or one document asked
many questions) hold the same physical blocks at the start of their block tables, and a speculative
step's verify rows of one request hold all of theirs in common. Paged decode reads every row's keys on
its own, so 256 rows behind a 3,584-token prefix read that prefix 256 times a layer. Here (the cascade
of Hydragen / FlashInfer):

    plan (host)     rows grouped by their first block; a row's shared length is the run of blocks its
                    table has in common with its group's first row (below its own last key), kept when
                    >= min_prefix keys and the group has >= min_rows such rows; among the rows left, a
                    request's own rows (neighbours with one table) grouped when they hold >=
                    min_request_prefix keys, in a step with >= min_request_groups such requests (one
                    program a request and KV head: "multi-query" attention for its verify or block
                    rows, worth it once they fill the GPU); each
                    group's rows sorted by that length and cut into tiles of ROWS rows
    this kernel     grid (tile, kv head): the tile's rows x the KV group's query heads as the rows of
                    one Q tile [ROWS * GROUP, D], against the prefix keys through the group's first
                    row's table (each row masked to its own length): partials (max, sum, acc) into
                    the last partial slot of each row
    decode kernel   each row's keys from its shared length on, in its splits (decode.py, SHARED)
    combine         the splits and the prefix slot merged by log-sum-exp (decode.py)

Exact against the plain path up to float rounding (the same online softmax, in another order). Eager
steps launch one program per tile; a CUDA graph captured for it (worker/cuda_graphs.py, a few buckets)
launches one per row of its bucket, the unused ones holding no rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from foveal.attention.kernels.tile import (
    NEG_INIT,
    dot_args,
    load_kv,
    pool_args,
    scales,
    softmax_step,
)

BLOCK_N = 64  # keys per tile
ROWS_PER_TILE = 16  # decode rows a program takes (x the KV group's query heads: the rows of its Q tile)


@dataclass(slots=True)
class SharedPrefixes:
    prefix_lens: torch.Tensor  # [D] int32: keys [0, len) of each decode row are its shared prefix's (0: none)
    rows: torch.Tensor  # [R] int32: the grouped decode rows, tile by tile
    tiles: torch.Tensor  # [num_tiles, 4] int32: (first index into rows, rows, longest prefix, table row)
    num_tiles: int


def may_share(first_blocks: np.ndarray, min_rows: int, request_rows: int = 0) -> bool:
    """Cheap pre-check: some first block is held by >= min_rows rows (min_rows 0: never), or, in a step
    of >= request_rows rows (0: never), two neighbouring rows start with the same block (a request's
    own rows)."""
    n, f = len(first_blocks), first_blocks
    if request_rows and n >= max(request_rows, 2) and bool(np.any((f[1:] == f[:-1]) & (f[1:] >= 0))):
        return True
    if not min_rows or n < min_rows:
        return False
    _, counts = np.unique(first_blocks, return_counts=True)
    return bool(counts.max() >= min_rows)


def _common_keys(tables, lens, seq_lens, rows, leaders, block_size: int) -> np.ndarray:
    """Keys each of `rows` shares with its leader: the run of equal leading blocks (within both
    tables), never the row's own last key."""
    run = np.cumprod(tables[rows] == tables[leaders], axis=1).sum(1)
    common = np.minimum(run, np.minimum(lens[rows], lens[leaders]))
    return np.minimum(common * block_size, seq_lens[rows] - 1)


def plan_groups(
    tables: np.ndarray,
    lens: np.ndarray,
    seq_lens: np.ndarray,
    block_size: int,
    min_rows: int,
    min_prefix: int,
    min_request_prefix: int = 0,
    min_request_groups: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefix_lens [D], rows [R], tiles [n, 4]) int32 for decode rows with block tables `tables` [D, W]
    (`lens` blocks each) and `seq_lens` keys (the new one included); empty rows / tiles: no sharing.

    Two kinds of group: the rows behind one first block when >= min_rows of them share >= min_prefix
    keys (min_rows 0: none), then, among the rows left, a request's own rows (neighbours with one
    table: verify rows, block rows) when >= 2 of them hold >= min_request_prefix keys (0: none) and the
    step has >= min_request_groups such requests (fewer: the plain kernel's key splits keep more of
    the GPU busy than one program a request and KV head)."""
    D = tables.shape[0]
    keep = np.zeros(D, dtype=np.int64)
    gid = np.full(D, -1, dtype=np.int64)  # each grouped row's group; its leader's table is read
    leader = np.arange(D)
    first = np.where(lens > 0, tables[:, 0], -1)
    every = np.arange(D)
    if min_rows and D >= min_rows:
        _, leader_of, group, counts = np.unique(
            first, return_index=True, return_inverse=True, return_counts=True
        )
    if min_rows and D >= min_rows and counts.max() >= min_rows:  # some first block's group is big enough
        lead = leader_of[group]  # each row's group's first row
        common = _common_keys(tables, lens, seq_lens, every, lead, block_size)
        others = np.zeros(len(leader_of), dtype=common.dtype)  # a leader shares what its group's others do
        np.maximum.at(others, group[lead != every], common[lead != every])
        common = np.where(lead == every, np.minimum(others[group], seq_lens - 1), common)
        common = np.where((common >= min_prefix) & (first >= 0), common, 0)
        sizes = np.bincount(group, weights=common > 0, minlength=len(leader_of))
        hit = (sizes[group] >= min_rows) & (common > 0)
        keep[hit], gid[hit], leader[hit] = common[hit], group[hit], lead[hit]
    if min_request_prefix and D >= 2 * max(min_request_groups, 1):
        last = tables[every, np.maximum(lens - 1, 0)]
        free = gid < 0
        same = (first[1:] == first[:-1]) & (lens[1:] == lens[:-1]) & (last[1:] == last[:-1])
        same &= (first[1:] >= 0) & free[1:] & free[:-1]
        run = np.cumsum(np.r_[True, ~same]) - 1  # neighbours with one table: a run
        lead = np.flatnonzero(np.r_[True, ~same])[run]
        rows = np.flatnonzero(free & (np.bincount(run)[run] >= 2))
        if len(rows):
            common = _common_keys(tables, lens, seq_lens, rows, lead[rows], block_size)
            common = np.where(common >= min_request_prefix, common, 0)
            sizes = np.bincount(run[rows], weights=common > 0, minlength=run[-1] + 1)
            hit = (sizes[run[rows]] >= 2) & (common > 0)
            runs = run[rows[hit]]  # nondecreasing: its distinct values are its changes + 1
            if len(runs) and np.count_nonzero(runs[1:] != runs[:-1]) + 1 >= min_request_groups:
                rows = rows[hit]
                keep[rows], gid[rows], leader[rows] = common[hit], D + run[rows], lead[rows]
    grouped = np.flatnonzero(gid >= 0)
    if not len(grouped):
        return np.zeros(D, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros((0, 4), dtype=np.int32)
    order = grouped[np.lexsort((-keep[grouped], gid[grouped]))]  # by group, longest prefix first
    g = gid[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    sizes = np.diff(np.r_[starts, len(order)])
    per = -(-sizes // ROWS_PER_TILE)  # tiles of each group
    owner = np.repeat(np.arange(len(starts)), per)
    t0 = starts[owner] + (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)) * ROWS_PER_TILE
    n = np.minimum(ROWS_PER_TILE, starts[owner] + sizes[owner] - t0)
    tiles = np.stack([t0, n, keep[order[t0]], leader[order[t0]]], axis=1)
    return keep.astype(np.int32), order.astype(np.int32), tiles.astype(np.int32)


@triton.jit(  # as the decode kernel: eager and graph steps share its variants (decode.py)
    do_not_specialize=["num_slots", "stride_table"],
    do_not_specialize_on_alignment=["tables_ptr", "rows_ptr", "tiles_ptr", "prefix_lens_ptr"],
)
def _shared_prefix_kernel(
    q_ptr,
    cache_ptr,
    scale_ptr,
    tables_ptr,
    rows_ptr,
    tiles_ptr,
    prefix_lens_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    cap_in,
    cap_out,
    num_slots,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_slot,
    stride_ch,
    stride_table,
    stride_skv,
    stride_sslot,
    stride_sh,
    GROUP: tl.constexpr,
    ROWS_PAD: tl.constexpr,  # >= 16 and >= rows a tile x GROUP, a power of two
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(tiles_ptr + tile * 4)
    count = tl.load(tiles_ptr + tile * 4 + 1)
    longest = tl.load(tiles_ptr + tile * 4 + 2)
    leader = tl.load(tiles_ptr + tile * 4 + 3)
    i = tl.arange(0, ROWS_PAD)
    r = i // GROUP
    ok = r < count
    row = tl.load(rows_ptr + first + r, mask=ok, other=0)
    plen = tl.load(prefix_lens_ptr + row, mask=ok, other=0)
    heads = kvh * GROUP + i % GROUP
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    q_mask = ok[:, None] & d_ok[None, :]
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0
    )
    m_i = tl.full([ROWS_PAD], NEG_INIT, tl.float32)
    l_i = tl.zeros([ROWS_PAD], tl.float32)
    acc = tl.zeros([ROWS_PAD, HEAD_PAD], tl.float32)
    k_base = cache_ptr + kvh * stride_ch + d[None, :]
    s_base = scale_ptr + kvh * stride_sh
    table = tables_ptr + leader * stride_table
    for n0 in range(0, longest, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < longest
        k, v = load_kv(
            k_base, s_base, table, pos, pos_ok, d, d_ok, q, stride_kv, stride_slot, stride_skv, stride_sslot,
            BLOCK_SIZE, GROUP_SIZE, QUANT,
        )  # fmt: skip
        allowed = pos[None, :] < plen[:, None]  # each row to its own shared length
        m_i, l_i, acc = softmax_step(
            q, k, v, allowed, m_i, l_i, acc, qk_scale, cap_in, cap_out, USE_SOFTCAP, DOT_PREC, UPCAST
        )
    part = (row * tl.num_programs(1) * GROUP + heads) * num_slots + num_slots - 1  # each row's last slot
    tl.store(part_ml_ptr + part * 2, m_i, mask=ok)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)


def shared_prefix_attention(
    q: torch.Tensor,  # [D, H, hd]
    kv_cache: torch.Tensor,  # [2, slots, kv_heads, hd]
    block_table: torch.Tensor,  # [D, max_blocks] int32
    shared: SharedPrefixes,
    part_acc: torch.Tensor,
    part_ml: torch.Tensor,
    num_slots: int,
    scale: float,
    softcap: float | None,
    block_size: int,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """The shared prefixes' partials into each grouped row's last slot (paged_decode calls it)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv = kv_cache.shape[2]
    group = num_heads // num_kv
    rows_pad = max(16, triton.next_power_of_2(ROWS_PER_TILE * group))
    qk_scale, cap_in, cap_out = scales(scale, softcap)
    scale_t, scale_strides, quant = pool_args(kv_cache, kv_scale)
    _shared_prefix_kernel[(shared.num_tiles, num_kv)](
        q, kv_cache, scale_t, block_table, shared.rows, shared.tiles, shared.prefix_lens, part_acc, part_ml,
        qk_scale, cap_in, cap_out, num_slots, q.stride(0), q.stride(1), *kv_cache.stride()[:3],
        block_table.stride(0), *scale_strides, GROUP=group, ROWS_PAD=rows_pad,
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N,
        USE_SOFTCAP=softcap is not None, **quant, **dot_args(q.dtype), num_warps=8 if rows_pad >= 128 else 4,
        num_stages=2,
    )  # fmt: skip
