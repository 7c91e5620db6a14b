"""Paged attention in Triton kernels (CUDA; the tests run them in Triton's interpreter on CPU). Same
contract as the torch backend (base.py), which is its oracle.

One step, one layer:

    q/k/v rows  [ d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]     decodes first, then prefill chunks
                    |             |
    store       every row's k/v -> cache[slot]  (kernels/store.py; slot < 0: a padding row, skipped)
                    |             |
    attend      paged_decode      paged_prefill        both read all keys from the paged cache
                (split-KV +       (query tiles x
                 combine)          kv heads x chunks)

plan() packs the step's integers into ONE int32 host tensor and copies it to the device once; every
device tensor of the metadata is a view of that copy:

    [ decode seq_lens (D) | cu_q_lens (P+1) | context_lens (P) | block tables (D+P rows x max_blocks) ]

each segment padded to a multiple of 4 int32s and max_blocks rounded up to one, so every view starts
16-byte aligned (Triton specializes pointers on that; varying alignments would mean more compiles).

Decode splits: the key range of each sequence is cut into num_splits tile-aligned pieces sized from its
own length (kernels/decode.py). plan() bounds num_splits by the longest decode (one split per
`split_tokens` keys, at most `max_splits`); forward() lowers it until decode rows x kv heads x splits
is about twice the multiprocessor count. Both are host ints, so a step never waits on the device.

CUDA graphs (decode-only steps): graph_metadata() allocates static buffers for max_seqs rows,

    static int32 [max_seqs, 2 + max_blocks_per_seq]:   slot | seq_len | block table ...

and fill_graph_metadata() writes one host tensor over the first `padded` rows (rows past the batch:
slot -1, seq_len 0, so they store nothing and attend to nothing) and returns views of those rows. The
split count then follows from max_blocks_per_seq and the padded row count, never from the batch's
lengths, so a graph captured for `padded` rows replays with any batch that fits.

Shared prefixes: when >= shared_min_rows decode rows hold the same leading blocks (the prefix cache's
sharing) for >= shared_min_prefix keys, or a request's own rows (speculation's verify rows, DFlash's and
block diffusion's block rows) hold >= request_min_prefix keys in a step of >= request_min_groups such,
plan() groups them
(kernels/shared_prefix.py) and packs [prefix lens | grouped rows | tiles] after the other segments:
the prefix is attended once per tile of rows, each row's decode starts past it, and the combine merges
both. Graphs: graph_metadata() holds a static buffer for the groups too, fill_graph_metadata(...,
shared=True) fills it, and a batch that shares_prefixes() replays a graph captured with the kernel.

Bidirectional spans (Gemma 3 images, a masked diffusion model's canvas) become one more segment of
the packed metadata: per prefill row the last key it sees (its position, or its span's end - 1), read
by the prefill kernel (kernels/prefill.py); decode rows need none (a last token sees everything before).

A quantized pool (kv_quant.QuantizedKVCache, `--kv-cache-dtype fp8|int8`) is read by the same kernels:
this step's k/v are quantized (torch ops on the device) and their codes and scales stored by the store
kernel (rows with a negative slot skipped, as for a plain pool), the kernels dequantize each K/V tile
as they gather it (kernels/tile.py load_kv), and the queries go into the pool's basis and the output
back out (int8's rotation), so graphs, splits, shared prefixes and windows work as over a plain pool.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from foveal.attention.base import AttentionBatch, graph_slots
from foveal.attention.kernels import paged_decode, paged_prefill, store_kv
from foveal.attention.kernels.decode import workspace_numel
from foveal.attention.kernels.shared_prefix import SharedPrefixes, may_share, plan_groups
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.device import to_device


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64 (plan) or int32 (graph); < 0: skip the row
    block_size: int
    num_decodes: int  # D: rows [0, D) are decodes
    num_prefill_tokens: int  # rows [D, D + this) are prefill chunks
    max_q_len: int  # longest prefill chunk (0: none)
    max_blocks: int  # block-table columns
    num_splits: int  # upper bound on decode key splits (forward may use fewer)
    decode_seq_lens: torch.Tensor  # [D] int32, context + 1; 0: padding row
    decode_block_table: torch.Tensor  # [D, max_blocks] int32, padded with block 0
    cu_q_lens: torch.Tensor  # [P + 1] int32, chunk offsets within the prefill rows
    context_lens: torch.Tensor  # [P] int32, tokens cached before each chunk
    prefill_block_table: torch.Tensor  # [P, max_blocks] int32
    workspace: torch.Tensor | None = None  # decode split partials, shared by the step's layers
    graph_buffer: torch.Tensor | None = None  # graph metadata: the static int32 buffer
    graph_shared: torch.Tensor | None = None  # graph metadata: the static shared-prefix buffer
    query_limits: torch.Tensor | None = None  # [prefill rows] int32: last key seen (bidirectional spans)
    shared: SharedPrefixes | None = None  # decode rows' shared prefixes (kernels/shared_prefix.py)


_NUM_SMS: dict[torch.device, int] = {}
CPU_NUM_SMS = 32  # the interpreter has no multiprocessors; a nominal count keeps the split logic tested


def _num_sms(device: torch.device) -> int:
    if device not in _NUM_SMS:
        if device.type == "cuda":
            _NUM_SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
        else:
            _NUM_SMS[device] = CPU_NUM_SMS
    return _NUM_SMS[device]


def _query_limits(batch: AttentionBatch) -> torch.Tensor:
    """Per prefill row, the last key position it sees: its own, or the end - 1 of the span it is in
    (int32, padded to a multiple of 4 like the other segments)."""
    out: list[int] = []
    nd = batch.num_decodes
    for q_len, ctx, spans in zip(batch.query_lens[nd:], batch.context_lens[nd:], batch.bidirectional[nd:]):
        lim = list(range(ctx, ctx + q_len))
        for lo, hi in spans:
            for p in range(max(lo, ctx), min(hi, ctx + q_len)):
                lim[p - ctx] = max(lim[p - ctx], hi - 1)
        out += lim
    return torch.tensor(out + [0] * (_round4(len(out)) - len(out)), dtype=torch.int32)


class _TableRows:
    """Block tables as one padded int32 array, each table converted once while it is in use. A
    request's table is one tuple from step to step until its blocks change (Request.block_table;
    a verify run's rows share it too), so a step converts only the tables that changed: at 256 rows of
    64 blocks the array then costs ~0.2 ms on the dev host instead of ~0.6. Tuples are kept across
    calls in two generations: once the newer holds `cap` tables it becomes the older, and a table not
    used again within a generation is dropped. A list may change in place, so it is converted at each
    call (once however many rows share it)."""

    def __init__(self, cap: int = 4096):
        self.cap = cap
        self._new: dict[int, tuple] = {}  # id -> (the tuple, kept alive so its id stays its own; row)
        self._old: dict[int, tuple] = {}

    def array(self, tables: list, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(tables padded with block 0 [len(tables), width] int32, their lengths) as numpy arrays."""
        new, old, lists = self._new, self._old, {}
        found = list(map(new.get, map(id, tables)))  # the common case at C speed: all seen before
        if None in found:
            for i, t in enumerate(tables):
                if found[i] is None:
                    k = id(t)
                    if type(t) is tuple:
                        e = new[k] = old.get(k) or (t, np.array(t, dtype=np.int32))
                    else:
                        e = lists[k] = lists.get(k) or (t, np.array(t, dtype=np.int32))
                    found[i] = e
        rows = [e[1] for e in found]
        if len(new) > self.cap:
            self._old, self._new = new, {}
        lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        out = np.zeros((len(tables), width), dtype=np.int32)
        if rows:
            out[np.arange(width)[None, :] < lens[:, None]] = np.concatenate(rows)
        return out, lens


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def _pad4(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(_round4(t.numel()) - t.numel())])


def _graph_rows(
    buf: torch.Tensor, rows: int, block_size: int, num_splits: int, shared_buf: torch.Tensor | None = None
) -> TritonAttentionMetadata:
    """Decode-only metadata over the first `rows` rows of a static graph buffer (views, same storage)."""
    head = buf[:rows]
    return TritonAttentionMetadata(
        slot_mapping=head[:, 0],
        block_size=block_size,
        num_decodes=rows,
        num_prefill_tokens=0,
        max_q_len=0,
        max_blocks=buf.shape[1] - 2,
        num_splits=num_splits,
        decode_seq_lens=head[:, 1],
        decode_block_table=head[:, 2:],
        cu_q_lens=buf[:0, 0],
        context_lens=buf[:0, 0],
        prefill_block_table=buf[:0, 2:],
        graph_buffer=buf,
        graph_shared=shared_buf,
    )


class TritonAttentionBackend:
    name = "triton"

    # on an H200, batch 1 at 8192 tokens ran 26 us with 32 splits and 23 us with 64 (one sweep, 2026-11);
    # from batch 64 up one split was best, which the programs-per-SM bound in decode_splits picks
    def __init__(
        self,
        split_tokens: int = 128,
        max_splits: int = 64,
        shared_min_rows: int = 64,
        shared_min_prefix: int = 1024,
        request_min_prefix: int = 0,
        request_min_groups: int = 32,
    ):
        self.split_tokens = split_tokens  # fewest keys worth a decode split of their own
        self.max_splits = max_splits
        # decode rows behind a shared prefix attend to it once per tile of rows (kernels/shared_prefix.py)
        # when >= shared_min_rows rows share >= shared_min_prefix keys (0 rows: never); the bar is high
        # until a GPU sweep sets it (a grouped step pads to a bucket of 64, 128, ... rows under graphs)
        self.shared_min_rows, self.shared_min_prefix = shared_min_rows, shared_min_prefix
        # a request's several decode rows read its keys once when it has >= request_min_prefix (0: never)
        # in steps with >= request_min_groups such requests (their programs, x the KV heads, then fill
        # the GPU; fewer keep the plain kernel's splits)
        self.request_min_prefix, self.request_min_groups = request_min_prefix, request_min_groups
        # (batch, bar, its groups, its tables as arrays or None): shares_prefixes() plans a batch, plan()
        # or the graph fill reuse it (and the fill the arrays)
        self._memo: tuple | None = None
        self._rows = _TableRows()  # the block tables' numpy rows, kept while their tuples are in use

    def _batch_plan(self, batch: AttentionBatch, tables: np.ndarray | None = None, lens=None):
        """The decode rows' groups (plan_groups' arrays) or None when none qualify, planned once per
        batch. `tables` / `lens`: its block tables as numpy arrays, where the caller has them."""
        bar = (self.shared_min_rows, self.shared_min_prefix, self.request_min_prefix, self.request_min_groups)
        if self._memo is not None and self._memo[0] is batch and self._memo[1] == bar:
            return self._memo[2]
        nd, plan, arrays = batch.num_decodes, None, None
        firsts = np.fromiter((t[0] if t else -1 for t in batch.block_tables[:nd]), dtype=np.int64, count=nd)
        requests = 2 * max(self.request_min_groups, 1) if self.request_min_prefix else 0
        if may_share(firsts, self.shared_min_rows, requests):  # else: no tables built
            if tables is None:
                width = max(1, max((len(t) for t in batch.block_tables[:nd]), default=1))
                tables, lens = arrays = self._rows.array(batch.block_tables[:nd], width)
            seqs = np.asarray(batch.context_lens[:nd], dtype=np.int64) + 1
            plan = plan_groups(tables[:nd], lens[:nd], seqs, batch.block_size, *bar)
            plan = plan if len(plan[2]) else None
        self._memo = (batch, bar, plan, arrays)  # holding the batch: its identity cannot be reused meanwhile
        return plan

    def _tables_of(self, batch: AttentionBatch, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The batch's block tables as arrays `width` wide: the ones _batch_plan built, when it did."""
        memo = self._memo
        if memo is not None and memo[0] is batch and memo[3] is not None and memo[3][0].shape[1] == width:
            return memo[3]
        return self._rows.array(batch.block_tables, width)

    def shares_prefixes(self, batch: AttentionBatch) -> bool:
        """Whether plan() would group this decode-only batch's rows (the runner then replays a graph
        captured with the shared-prefix kernel, or runs the step eagerly)."""
        return self._batch_plan(batch) is not None

    def _splits_for(self, max_len: int) -> int:
        return max(1, min(self.max_splits, -(-max_len // self.split_tokens)))

    def plan(self, batch: AttentionBatch, device: torch.device) -> TritonAttentionMetadata:
        nd = batch.num_decodes
        q_lens, ctxs, tables = batch.query_lens, batch.context_lens, batch.block_tables
        n, num_prefills = len(q_lens), len(q_lens) - nd
        # every segment (and the table width) a multiple of 4 int32s: each view then starts 16-byte
        # aligned, as Triton specializes pointer arguments on that; otherwise the alignments of a step's
        # views would vary with its batch and every new combination would compile another kernel
        width = _round4(max(1, max((len(t) for t in tables), default=1)))
        prefill_lens = q_lens[nd:]
        a = _round4(nd)
        b = a + _round4(num_prefills + 1)
        c = b + _round4(num_prefills)
        limits = _query_limits(batch) if batch.bidirectional is not None else None
        head = torch.zeros(c, dtype=torch.int32)
        head[:nd] = torch.tensor([x + 1 for x in ctxs[:nd]], dtype=torch.int32)
        head[a : a + num_prefills + 1] = torch.tensor(
            list(itertools.accumulate(prefill_lens, initial=0)), dtype=torch.int32
        )
        head[b : b + num_prefills] = torch.tensor(ctxs[nd:], dtype=torch.int32)
        table_array, lens = self._rows.array(tables, width)
        parts = [head, torch.from_numpy(table_array).view(-1)]
        if limits is not None:
            parts.append(limits)
        shared = self._batch_plan(batch, table_array, lens)
        if shared is not None:  # [prefix_lens (nd) | rows | tiles], each padded to 4 int32s
            plens, rows, tiles = (torch.from_numpy(a.reshape(-1)) for a in shared)
            parts += [_pad4(plens), _pad4(rows), tiles]
        dev = to_device(torch.cat(parts), device)  # one copy
        all_tables = dev[c : c + n * width].view(n, width)
        end = c + n * width + (0 if limits is None else limits.numel())
        if shared is not None:
            p, r = end + _round4(nd), end + _round4(nd) + _round4(len(shared[1]))
            shared = SharedPrefixes(
                dev[end : end + nd], dev[p : p + len(shared[1])], dev[r:].view(-1, 4), len(shared[2])
            )
        return TritonAttentionMetadata(
            slot_mapping=batch.slot_mapping,
            block_size=batch.block_size,
            num_decodes=nd,
            num_prefill_tokens=sum(prefill_lens),
            max_q_len=max(prefill_lens, default=0),
            max_blocks=width,
            num_splits=self._splits_for(max(ctxs[:nd], default=0) + 1),
            decode_seq_lens=dev[:nd],
            decode_block_table=all_tables[:nd],
            cu_q_lens=dev[a : a + num_prefills + 1],
            context_lens=dev[b : b + num_prefills],
            prefill_block_table=all_tables[nd:],
            query_limits=None if limits is None else dev[c + n * width : end],
            shared=shared,
        )

    def graph_metadata(
        self, max_seqs: int, max_blocks_per_seq: int, block_size: int, device
    ) -> TritonAttentionMetadata:
        """Static buffers for decode-only steps of up to max_seqs rows (see the module docstring)."""
        buf = torch.zeros(max_seqs, 2 + max_blocks_per_seq, dtype=torch.int32, device=device)
        buf[:, 0] = -1
        splits = self._splits_for(max_blocks_per_seq * block_size)
        # [prefix lens (max_seqs) | grouped rows (max_seqs) | tiles (max_seqs x 4)]: a graph captured
        # with shared prefixes launches one tile program per row of its bucket (unused tiles hold 0 rows)
        groups = self.shared_min_rows or self.request_min_prefix
        shared = torch.zeros(6 * max_seqs, dtype=torch.int32, device=device) if groups else None
        return _graph_rows(buf, max_seqs, block_size, splits, shared)

    def fill_graph_metadata(
        self, static: TritonAttentionMetadata, batch: AttentionBatch, padded: int, shared: bool = False
    ) -> TritonAttentionMetadata:
        """Copy a decode-only batch into the static buffers (one host->device copy) and return metadata
        over their first `padded` rows; rows past the batch store nothing and attend to nothing.
        `shared`: also the batch's shared-prefix groups (none when it has none), for a graph captured
        with them."""
        buf = static.graph_buffer
        n, bs, width = len(batch.query_lens), static.block_size, static.max_blocks
        assert buf is not None, "not graph metadata: make it with graph_metadata()"
        assert batch.num_decodes == n and n <= padded <= buf.shape[0], (n, padded, buf.shape[0])
        assert batch.block_size == bs and batch.bidirectional is None
        ctxs, tables = batch.context_lens, batch.block_tables
        # only the columns this batch's tables reach: the kernels never read past a row's seq_len, so
        # stale entries further right are harmless (a long max_model_len must not cost a big copy)
        used = max(map(len, tables)) if n else 0
        if used > width:
            raise ValueError(f"a block table of {used} blocks exceeds the graph's {width}")
        host = torch.zeros(padded, 2 + used, dtype=torch.int32)
        host[:, 0] = -1
        host[:n, 0] = graph_slots(batch)
        host[:n, 1] = torch.tensor(ctxs, dtype=torch.int32) + 1
        table_array, lens = self._tables_of(batch, used)
        host[:n, 2:] = torch.from_numpy(table_array)
        buf[:padded, : 2 + used].copy_(host.pin_memory() if buf.is_cuda else host, non_blocking=True)
        meta = _graph_rows(buf, padded, bs, static.num_splits, static.graph_shared)
        if shared:
            meta.shared = self._fill_graph_shared(static.graph_shared, batch, table_array, lens, padded)
        return meta

    @staticmethod
    def shift_graph_metadata(
        meta: TritonAttentionMetadata, n: int, shift: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """Move the first n rows of filled graph metadata on, on the device, for steps whose positions
        only the device knows (a drafter that follows a verify step by its accepted counts): each row's
        length by `shift` [n], and its slot to key `index` [n] of its block table (< 0: it writes
        nothing; by default its last key, length - 1). The tables must reach the keys."""
        rows, bs = meta.graph_buffer[:n], meta.block_size
        lens = rows[:, 1] + shift.to(torch.int32)
        idx = lens - 1 if index is None else index.to(torch.int32)
        block = rows[:, 2:].gather(1, (idx.clamp(min=0) // bs).long()[:, None])[:, 0]
        rows[:, 0] = torch.where(idx >= 0, block * bs + idx % bs, -1)
        rows[:, 1] = lens

    def _fill_graph_shared(self, sb, batch: AttentionBatch, tables, lens, padded: int) -> SharedPrefixes:
        """The batch's groups into the static shared-prefix buffer (zeros where it has none): views over
        `padded` rows and `padded` tiles, the grid a graph of that bucket was captured with."""
        if sb is None:
            raise ValueError("graph metadata made without shared prefixes (no grouping was on)")
        M = sb.numel() // 6
        host = torch.zeros(6 * M, dtype=torch.int32)
        plan = self._batch_plan(batch, tables, lens)
        if plan is not None:
            plens, rows, tiles = plan
            host[: len(plens)] = torch.from_numpy(plens)
            host[M : M + len(rows)] = torch.from_numpy(rows)
            host[2 * M : 2 * M + tiles.size] = torch.from_numpy(tiles.reshape(-1))
        sb.copy_(host.pin_memory() if sb.is_cuda else host, non_blocking=True)
        return SharedPrefixes(
            sb[:padded], sb[M : M + padded], sb[2 * M : 2 * M + 4 * padded].view(padded, 4), padded
        )

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        meta: TritonAttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        pool, kv_scale = kv_cache, None
        if isinstance(kv_cache, QuantizedKVCache):  # codes and scales, read in the pool's basis
            (kq, ks), (vq, vs) = kv_cache.quantize(k), kv_cache.quantize(v)
            codes = kv_cache.codes
            store_kv(kq.view(codes.dtype), vq.view(codes.dtype), codes, meta.slot_mapping)
            store_kv(ks, vs, kv_cache.scale, meta.slot_mapping)
            pool, kv_scale, q = kv_cache.data, kv_cache.scale, kv_cache.to_pool_basis(q)
        else:
            store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd, num_heads, head_dim = meta.num_decodes, q.shape[1], q.shape[2]
        if nd:
            splits = self.decode_splits(meta, pool.shape[2], q.device)
            shared = meta.shared if window is None else None  # windowed layers: the plain path
            need = workspace_numel(nd, num_heads, head_dim, splits, shared is not None)
            if need and (meta.workspace is None or meta.workspace.numel() < need):
                meta.workspace = torch.empty(need, dtype=torch.float32, device=q.device)
            paged_decode(
                q[:nd],
                pool,
                meta.decode_block_table,
                meta.decode_seq_lens,
                out[:nd],
                scale,
                block_size=meta.block_size,
                num_splits=splits,
                window=window,
                softcap=softcap,
                workspace=meta.workspace,
                sinks=sinks,
                shared=shared,
                kv_scale=kv_scale,
            )
        if meta.num_prefill_tokens:
            paged_prefill(
                q[nd:],
                pool,
                meta.prefill_block_table,
                meta.cu_q_lens,
                meta.context_lens,
                out[nd:],
                scale,
                block_size=meta.block_size,
                max_q_len=meta.max_q_len,
                window=window,
                softcap=softcap,
                query_limits=meta.query_limits,
                sinks=sinks,
                kv_scale=kv_scale,
            )
        return out if kv_scale is None else kv_cache.from_pool_basis(out)

    def decode_splits(self, meta: TritonAttentionMetadata, num_kv_heads: int, device) -> int:
        """Key splits of the step's decode rows: enough programs (rows x kv heads x splits) to fill the
        GPU about twice over, no more than the lengths justify (meta.num_splits). Host ints only."""
        programs = max(1, meta.num_decodes * num_kv_heads)
        return max(1, min(meta.num_splits, -(-2 * _num_sms(torch.device(device)) // programs)))
