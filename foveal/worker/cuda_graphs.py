"""CUDA graphs for decode steps: one graph per batch-size bucket, captured at start-up.

A decode step of an 8B model is ~1,000 small kernel launches; at ~10 µs of host time each, launching
them costs more than the GPU needs to run them. A graph replays the whole step (embedding, every
layer, the LM head) with one launch. Graphs need fixed addresses and shapes, so inputs live in static
buffers that each step copies into, and a batch of n rows runs the graph of the smallest bucket
>= n; the padding rows compute garbage nobody reads and write no KV (slot -1).

    buckets 1 2 4 8 16 24 32 ... max_num_seqs      batch of 13 rows -> bucket 16 (3 padding rows)

    static: input_ids [max] positions [max]  + the backend's graph metadata (block tables, lengths)
    graph[b] reads the first b rows of each and writes the first b rows of logits [max, vocab]

Graphs share one memory pool, captured largest first so the smaller ones reuse its blocks; their
intermediates (the LM head's output too) are freed after capture, so the pool holds one step's
worth, and the one static logits buffer is the only per-row output. Only
backends with `graph_metadata` / `fill_graph_metadata` (Triton) take part; prefill and mixed steps,
and steps with images, run eagerly.

On a CPU device nothing is captured: `run` executes the same static-buffer forward eagerly. Tests use
that to check the buffers, buckets and padding rows without a GPU. (The engine's CPU counterpart is
worker/cpu_graphs.py's CpuDecodeGraphs, which records each bucket's step and replays it.)
"""

from __future__ import annotations

import logging
import time

import torch

from foveal.attention.base import AttentionBatch
from foveal.device import to_device
from foveal.models.base import StepContext

log = logging.getLogger(__name__)


def batch_buckets(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_seqs (and max_seqs itself)."""
    out = [b for b in (1, 2, 4) if b < max_seqs] + list(range(8, max_seqs, 8))
    return out + [max_seqs]


def supports_graphs(backend) -> bool:
    return hasattr(backend, "graph_metadata") and hasattr(backend, "fill_graph_metadata")


class DecodeGraphs:
    shared_prefixes = True  # graphs with the shared-prefix kernel too (not the one-row-a-request heads')

    def __init__(
        self,
        model,
        kv_caches,
        backend,
        *,
        block_size: int,
        max_seqs: int,
        max_model_len: int,
        device,
        tap=None,
        lora_groups: int = 0,
    ):
        self.model = model
        self.tap = tap  # a hidden-state drafter's (ModelRunner.tap): its rows land in `tapped` too
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.buckets = batch_buckets(max_seqs)
        self.max_seqs = max_seqs
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
        self.meta = backend.graph_metadata(max_seqs, self.max_blocks, block_size, self.device)
        # LoRA (lora_groups = adapter slots + the base group): the step's rows grouped by slot, an input
        # like the token ids (foveal/lora/stacks.py LoRABatch). A step with an adapter row replays a graph
        # of `lora_graphs` (which adapters, in which rows, is data: one graph serves every mixture); a
        # step of base rows only, the plain graph (no LoRA kernels)
        self.lora_groups = lora_groups
        if lora_groups:
            self.lora_perm = torch.zeros(max_seqs, dtype=torch.long, device=self.device)
            self.lora_offs = torch.full((lora_groups,), max_seqs, dtype=torch.int32, device=self.device)
            self.lora_offs[:-1] = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # the same steps with the LoRA kernels
        # steps whose rows share a prefix (the backend's shares_prefixes): graphs with the shared-prefix
        # kernel, for a few buckets from the backend's bar up (a batch pads to the next of them), or
        # from its bar for a request's own rows (verify rows, block rows) when they group
        bar = getattr(backend, "shared_min_rows", 0) if self.shared_prefixes else 0
        if self.shared_prefixes and getattr(backend, "request_min_prefix", 0):
            least = 2 * max(backend.request_min_groups, 1)  # rows of the fewest requests that group
            bar = min(bar or least, least)
        self.shared_buckets = [
            b for b in self.buckets if bar and b >= bar and (b & (b - 1) == 0 or b % 64 == 0 or b == max_seqs)
        ]  # powers of two and multiples of 64
        self.shared_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captured_shared_meta: dict[int, object] = {}
        # the metadata each graph was captured with: a replay reads and writes the tensors the capture
        # saw (the backend's split-KV workspace is made by the warm-up forward and hangs off this
        # object), so they must live as long as the graph; dropped, their memory goes back to the
        # allocator and a replay writes into whatever reuses it (W4 faulted so on the H200)
        self.captured_meta: dict[int, object] = {}
        self.logits: torch.Tensor | None = None  # [max_seqs, vocab], made by the first warm-up
        self.tapped: torch.Tensor | None = None  # [max_seqs, H]: the tap's rows (with a tap)
        self._bucket_of = [0] * (max_seqs + 1)  # n rows -> the smallest bucket >= n
        b = 0
        for n in range(1, max_seqs + 1):
            while self.buckets[b] < n:
                b += 1
            self._bucket_of[n] = self.buckets[b]

    @property
    def emulated(self) -> bool:
        return self.device.type != "cuda"

    @torch.inference_mode()
    def capture(self) -> None:
        if self.emulated:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for b in reversed(self.buckets):
            batch = AttentionBatch(
                query_lens=[1] * b,
                context_lens=[0] * b,
                block_tables=[[0]] * b,
                num_decodes=b,
                slot_mapping=torch.full((b,), -1, dtype=torch.long),  # writes nothing (a host tensor)
                block_size=self.block_size,
            )
            meta = self.backend.fill_graph_metadata(self.meta, batch, b)
            for graphs, lora in ((self.graphs, False), (self.lora_graphs, True)):
                if lora and not self.lora_groups:
                    continue
                graphs[b] = self._capture(b, meta, pool, stream, lora)
            self.captured_meta[b] = meta
            if b in self.shared_buckets:
                meta = self.backend.fill_graph_metadata(self.meta, batch, b, shared=True)
                self.shared_graphs[b] = self._capture(b, meta, pool, stream)
                self.captured_shared_meta[b] = meta
        torch.cuda.synchronize(self.device)
        log.info(
            "captured %d CUDA graphs for decode batches up to %d in %.1f s",
            len(self.graphs) + len(self.lora_graphs) + len(self.shared_graphs),
            self.max_seqs,
            time.perf_counter() - t0,
        )

    def _capture(self, b: int, meta, pool, stream, lora: bool = False) -> torch.cuda.CUDAGraph:
        kw = {"lora": True} if lora else {}  # (the drafters' graphs take (b, meta) only)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward(b, meta, **kw)  # warm-up: kernels compile outside the capture
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._forward(b, meta, **kw)
        return graph

    def takes_shared(self, n: int) -> bool:
        """Whether a batch of n rows that shares prefixes has a graph (else it runs eagerly)."""
        return bool(self.shared_buckets) and n <= self.shared_buckets[-1]

    def _shared_bucket(self, n: int) -> int:
        return next(b for b in self.shared_buckets if b >= n)

    def _forward(self, b: int, meta, lora: bool = False) -> None:
        ctx = StepContext(self.positions[:b], self.kv_caches, meta)
        if lora:
            from foveal.lora.stacks import LoRABatch

            ctx.lora = LoRABatch(self.lora_perm[:b], self.lora_offs)
        if self.tap is not None:
            ctx.aux_layers, ctx.aux = self.tap.tap_layers, []
        hidden = self.model(self.input_ids[:b], ctx)
        if self.tap is not None:
            tapped = self.tap.fuse(ctx.aux, hidden)
            if self.tapped is None:
                self.tapped = tapped.new_empty(self.max_seqs, tapped.shape[1])
            self.tapped[:b].copy_(tapped)
        logits = self.model.compute_logits(hidden)
        if self.logits is None:
            self.logits = logits.new_empty(self.max_seqs, logits.shape[1])
        self.logits[:b].copy_(logits)

    @staticmethod
    def reserve_bytes(max_seqs: int, vocab_size: int, dtype: torch.dtype) -> int:
        """What the graphs will hold, for memory sizing: the logits buffer, the largest graph's LM-head
        output and its other intermediates (small at decode sizes: 256 MiB is plenty)."""
        return 2 * max_seqs * vocab_size * max(dtype.itemsize, 4) + (256 << 20)

    def fits(self, num_seqs: int, max_len: int) -> bool:
        return 0 < num_seqs <= self.max_seqs and max_len <= self.max_blocks * self.block_size

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, lora=None, shared=False
    ) -> torch.Tensor:
        """Logits [n, vocab] of a decode-only batch of n rows (inputs already on the device). `lora`:
        per item (adapter slot, rows) when LoRA is on (foveal/lora/slots.py group_rows). `shared`: the
        rows share prefixes (takes_shared(n) must hold; a step with adapter rows takes the LoRA graph
        and attends plainly)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        lora = self.fill_lora(lora, n)
        self.replay(batch, n, lora, shared and not lora)
        return self.logits[:n]

    def fill_lora(self, groups, n: int) -> bool:
        """The static LoRA grouping of the n rows' bucket (padding rows in the base group); whether
        any row has an adapter (else nothing is filled)."""
        base = self.lora_groups - 1
        if not self.lora_groups or not groups or all(g == base for g, _ in groups):
            return False
        from foveal.lora.slots import group_rows

        b = self._bucket_of[n]
        packed = group_rows(groups, self.lora_groups, b)
        dev = to_device(torch.tensor(packed, dtype=torch.long), self.device)
        self.lora_perm[:b].copy_(dev[:b])
        self.lora_offs.copy_(dev[b:])
        return True

    def replay(
        self, batch: AttentionBatch, n: int, lora: bool = False, shared: bool = False, moved=None
    ) -> None:
        """Run the graph of n rows' bucket over the static inputs (eagerly where nothing is captured);
        `lora`: the variant with the LoRA kernels; `shared`: the one with the shared-prefix kernel;
        `moved`: (shift, index) device tensors for the backend's shift_graph_metadata after the fill
        (rows whose lengths and slots only the device knows)."""
        if shared:
            b = self._shared_bucket(n)
            meta = self.backend.fill_graph_metadata(self.meta, batch, b, shared=True)
            if moved is not None:
                self.backend.shift_graph_metadata(meta, n, *moved)
            self._forward(b, meta) if self.emulated else self.shared_graphs[b].replay()
            return
        b = self._bucket_of[n]
        meta = self.backend.fill_graph_metadata(self.meta, batch, b)
        if moved is not None:
            self.backend.shift_graph_metadata(meta, n, *moved)
        if self.emulated:
            self._forward(b, meta, lora=True) if lora else self._forward(b, meta)
        else:
            (self.lora_graphs if lora else self.graphs)[b].replay()
