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
from foveal.attention.base import AttentionBatch
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

    def _decode_in_place(self, q, kv_cache, meta, out, scale, window, softcap) -> bool:
        d = meta.extra
        if d is None or isinstance(kv_cache, QuantizedKVCache) or q.dtype != kv_cache.dtype:
            return False
        if not out.is_contiguous():
            return False
        starts = d.starts.get(window)
        if starts is None:
            starts = d.starts[window] = (d.lens - window).clamp_(min=0)
        self.kernel.decode(
            q, kv_cache[0], kv_cache[1], d.tables, starts, d.lens, out, meta.block_size, scale, softcap
        )
        return True
