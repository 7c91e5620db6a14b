"""The torch backend with every query row on a native CPU kernel (cpu_native: cpu_attention.c), which
reads keys and values in place from the paged pool: no gather, no padding mask, fp32 accumulation.

A prompt chunk's rows go through the same kernel as decode rows, each row attending to its own keys
over a grid of key chunks at absolute positions: a row's output depends on its query, its keys and
their range only. So the output of a token is the same whether its prompt was computed whole, in
chunks, after a prefix-cache hit, beside other requests or one token at a time; with GGUF's int8
activations, where a rounding step of difference grows into a different answer, this keeps a greedy
answer the same from a cold cache and a warm one (SDPA's tiling depends on the query and key lengths).

On the 2-vCPU AVX2 host, in a SmolLM2 decode step (32 rows, ~170 keys each, bf16), the gather + SDPA
took ~2.3 ms per layer and the kernel takes ~0.9 ms; the step went from 275 to 220 ms
(benchmarks/RESULTS.md, `decode_profile.py --attention-backend both`). Prompt chunks with bidirectional
spans (an image's tokens, Gemma 3) take the torch path's masks; quantized pools (int8/fp8) and devices
other than the CPU take the torch path for every row; so does everything when the kernel cannot be
built (no C compiler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foveal.attention import cpu_native
from foveal.attention.base import AttentionBatch, graph_slots
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata


@dataclass(slots=True)
class _RowTables:
    """What the kernel reads for the rows it takes: every row of the step, or its decode rows."""

    tables: torch.Tensor  # [sequences, max blocks] int64, padded with the null block
    lens: torch.Tensor  # [rows] int64: the keys each row sees end here (its position + 1)
    starts: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> first visible key
    row_seq: torch.Tensor | None = None  # [rows] int64: each row's sequence (None: row i is sequence i)


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: cpu_native.AttentionKernel | None = None):
        self.kernel = kernel or cpu_native.kernel()

    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        meta = super().plan(batch, device)
        nd = batch.num_decodes
        if self.kernel is None or torch.device(device).type != "cpu" or not batch.query_lens:
            return meta
        # the rows the kernel takes: all of them, but for prompt chunks with bidirectional spans
        n = len(batch.query_lens) if not any(s.spans for s in meta.seqs[nd:]) else nd
        if not n:
            return meta
        q_lens, ctxs = batch.query_lens[:n], batch.context_lens[:n]
        # the decode rows' tables: the torch plan's padded gather ids, row-major; then the prompt chunks'
        padded = meta.decode.blocks.view(nd, -1) if nd else torch.zeros(0, 0, dtype=torch.long)
        if n > nd:
            rest = batch.block_tables[nd:n]
            width = max(padded.shape[1], *(len(t) for t in rest))
            rest = torch.tensor([[*t, *[0] * (width - len(t))] for t in rest], dtype=torch.long)
            padded = torch.cat([torch.nn.functional.pad(padded, (0, width - padded.shape[1])), rest])
        if n == nd:  # one row a sequence
            lens, row_seq = torch.tensor(ctxs, dtype=torch.long) + 1, None
        else:  # row r of sequence s (its i-th new token) sees keys up to ctx[s] + i + 1
            q = torch.tensor(q_lens, dtype=torch.long)
            row_seq = torch.repeat_interleave(torch.arange(n), q)
            first = torch.repeat_interleave(torch.cumsum(q, 0) - q, q)  # each row's sequence's first row
            lens = torch.tensor(ctxs, dtype=torch.long)[row_seq] + torch.arange(len(row_seq)) - first + 1
        meta.extra = _RowTables(padded, lens, {None: torch.zeros(len(lens), dtype=torch.long)}, row_seq)
        return meta

    # -- decode-step graphs (worker.cpu_graphs): static metadata the recorded steps read -----------
    def graph_metadata(self, max_seqs: int, max_blocks: int, block_size: int, device):
        """Static buffers for decode-only steps of up to max_seqs rows: slots, block tables, lengths."""
        if self.kernel is None:
            raise RuntimeError("decode-step graphs need the native attention kernel")

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long)

        meta = TorchAttentionMetadata(zeros(max_seqs), block_size, max_seqs, None, [], [], device)
        meta.extra = _RowTables(zeros(max_seqs, max_blocks), zeros(max_seqs), {None: zeros(max_seqs)})
        return meta

    def fill_graph_metadata(
        self, static: TorchAttentionMetadata, batch: AttentionBatch, padded: int
    ) -> TorchAttentionMetadata:
        """Copy a decode-only batch into the static buffers and return metadata over their first
        `padded` rows. Rows past the batch attend to nothing (length 0) and write their K/V into the
        null block (slot 0), which no sequence reads."""
        n, bs, d = len(batch.query_lens), static.block_size, static.extra
        assert batch.num_decodes == n <= padded <= d.lens.shape[0], (n, padded, d.lens.shape[0])
        used = max(len(t) for t in batch.block_tables)
        if used > d.tables.shape[1]:
            raise ValueError(f"a block table of {used} blocks exceeds the graph's {d.tables.shape[1]}")
        ctxs, tables = batch.context_lens, batch.block_tables
        host = torch.zeros(padded, 2 + used, dtype=torch.long)
        host[:n, 0] = graph_slots(batch)
        host[:n, 1] = torch.tensor(ctxs) + 1
        host[:n, 2:] = torch.tensor([[*t, *[0] * (used - len(t))] for t in tables])
        static.slot_mapping[:padded] = host[:, 0]
        d.lens[:padded] = host[:, 1]
        d.tables[:padded, :used] = host[:, 2:]
        meta = TorchAttentionMetadata(static.slot_mapping[:padded], bs, padded, None, [], [], static.device)
        meta.extra = _RowTables(d.tables[:padded], d.lens[:padded], {None: d.starts[None][:padded]})
        return meta

    @staticmethod
    def shift_graph_metadata(
        meta: TorchAttentionMetadata, n: int, shift: torch.Tensor, index: torch.Tensor | None = None
    ) -> None:
        """Move the first n rows of filled graph metadata on (triton_backend's counterpart): lengths by
        `shift`, slots to key `index` of the block tables (< 0: the null block's slot 0, which no
        sequence reads; by default the row's last key)."""
        d, bs = meta.extra, meta.block_size
        lens = d.lens[:n] + shift
        idx = lens - 1 if index is None else index
        slots = d.tables[:n].gather(1, (idx.clamp(min=0) // bs)[:, None])[:, 0] * bs + idx % bs
        meta.slot_mapping[:n] = torch.where(idx >= 0, slots, 0)
        d.lens[:n] = lens

    def _store(self, k_cache, v_cache, slots, k, v) -> None:
        # one native call for both: two index_copy_ took ~6.5 us each per layer at one row (0.4 ms of a
        # 9 ms single-stream step), ~12 us at 16
        if self.kernel is None or not self.kernel.store(k_cache, v_cache, slots, k, v):
            super()._store(k_cache, v_cache, slots, k, v)

    def _rows_in_place(self, q, kv_cache, meta, out, scale, window, softcap, sinks=None) -> int:
        d = meta.extra
        if d is None or isinstance(kv_cache, QuantizedKVCache) or q.dtype != kv_cache.dtype:
            return 0
        starts = d.starts.get(window)
        if starts is None:
            starts = d.starts[window] = (d.lens - window).clamp_(min=0)
        if sinks is not None:
            sinks = sinks.float().contiguous()
        n = d.lens.shape[0]
        self.kernel.attend(
            q[:n], kv_cache[0], kv_cache[1], d.tables, starts, d.lens, out[:n], meta.block_size, scale,
            softcap, sinks, d.row_seq,
        )  # fmt: skip
        return n
