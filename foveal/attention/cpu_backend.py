"""The torch backend with decode rows on a native CPU kernel (cpu_native: cpu_decode.c), which reads
keys and values in place from the paged pool: no gather, no padding mask, fp32 accumulation.

On the 2-vCPU AVX2 host, in a SmolLM2 decode step (32 rows, ~170 keys each, bf16), the gather + SDPA
took ~2.3 ms per layer and the kernel takes ~0.9 ms; the step went from 275 to 220 ms
(benchmarks/RESULTS.md, `decode_profile.py --attention-backend both`). Prefill chunks, quantized
pools (int8/fp8) and devices other than the CPU take the torch path unchanged; so does everything
when the kernel cannot be built (no C compiler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foveal.attention import cpu_native
from foveal.attention.base import AttentionBatch, graph_slots
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.attention.torch_backend import TorchAttentionBackend, TorchAttentionMetadata


@dataclass(slots=True)
class _DecodeTables:
    tables: torch.Tensor  # [nd, max blocks] int64, padded with the null block
    lens: torch.Tensor  # [nd] int64: keys of each decode row (its context + itself)
    starts: dict[int | None, torch.Tensor] = field(default_factory=dict)  # window -> first visible key


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: cpu_native.DecodeKernel | None = None):
        self.kernel = kernel or cpu_native.kernel()

    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        meta = super().plan(batch, device)
        nd = batch.num_decodes
        if nd and self.kernel is not None and torch.device(device).type == "cpu":
            # the torch plan's decode block ids are the padded tables, row-major
            tables = meta.decode.blocks.view(nd, -1)
            lens = torch.tensor([c + 1 for c in batch.context_lens[:nd]], dtype=torch.long)
            meta.extra = _DecodeTables(tables, lens, {None: torch.zeros(nd, dtype=torch.long)})
        return meta

    # -- decode-step graphs (worker.cpu_graphs): static metadata the recorded steps read -----------
    def graph_metadata(self, max_seqs: int, max_blocks: int, block_size: int, device):
        """Static buffers for decode-only steps of up to max_seqs rows: slots, block tables, lengths."""
        if self.kernel is None:
            raise RuntimeError("decode-step graphs need the native decode kernel")

        def zeros(*shape):
            return torch.zeros(*shape, dtype=torch.long)

        meta = TorchAttentionMetadata(zeros(max_seqs), block_size, max_seqs, None, [], [], device)
        meta.extra = _DecodeTables(zeros(max_seqs, max_blocks), zeros(max_seqs), {None: zeros(max_seqs)})
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
        meta.extra = _DecodeTables(d.tables[:padded], d.lens[:padded], {None: d.starts[None][:padded]})
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

    def _decode_in_place(self, q, kv_cache, meta, out, scale, window, softcap, sinks=None) -> bool:
        d = meta.extra
        if d is None or isinstance(kv_cache, QuantizedKVCache) or q.dtype != kv_cache.dtype:
            return False
        if not out.is_contiguous():
            return False
        starts = d.starts.get(window)
        if starts is None:
            starts = d.starts[window] = (d.lens - window).clamp_(min=0)
        if sinks is not None:
            sinks = sinks.float().contiguous()
        self.kernel.decode(
            q, kv_cache[0], kv_cache[1], d.tables, starts, d.lens, out, meta.block_size, scale, softcap, sinks
        )
        return True
