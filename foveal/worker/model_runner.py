"""Runs one scheduled step: builds the flat input tensors, plans attention once, encodes the images
the step's prefill chunks reach (vision cache first), runs the model, computes logits only for rows
that sample, and samples with each row's own parameters.

    tokens: [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     decodes first, then prefill chunks
    sample:  x  x  x              x          x   (last token of a chunk that reaches the end)
    images:                 [i i]                 rows of p0 inside an image span take its embeddings
                                                  (DeepStack models: and add more at early layers)

An image's embeddings stay on its request until the prefill passes the end of its span, so a chunk
boundary inside the span neither re-encodes nor depends on the cache keeping the entry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from foveal.attention.base import AttentionBatch
from foveal.device import to_device
from foveal.request import PENDING_TOKEN, Request, TokenLogprobs
from foveal.sample.sampler import Sampler, SamplingRow
from foveal.sched.batch import ScheduledBatch


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


@dataclass(slots=True)
class Launched:
    """A step whose device work is queued: its tokens reach the host with `collect`. The next step may
    be launched first; its decode rows whose input is still PENDING_TOKEN read it from `tokens`."""

    batch: ScheduledBatch
    requests: list[Request]  # the sampling rows' requests, in row order
    tokens: torch.Tensor | None = None  # [rows] on the device
    host: torch.Tensor | None = None  # their host copy (pinned on CUDA), valid once `event` is done
    event: object = None  # torch.cuda.Event, or None (CPU: already done)
    logprobs: list = field(default_factory=list)
    row_of: dict[str, int] = field(default_factory=dict)  # request id -> row of `tokens`


class ModelRunner:
    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        backend,
        block_size: int,
        device,
        vocab_size: int,
        encoder_cache=None,
    ):
        self.model = model
        self.encoder_cache = encoder_cache
        self.uses_mrope = bool(getattr(model, "uses_mrope", False))
        # DeepStack (Qwen3-VL): image embeddings carry k more hidden-sized vectors per row, added after
        # decoder layers 0..k-1; only the first `hidden` columns go into the input embeddings
        self.deepstack_layers = int(getattr(model, "deepstack_layers", 0))
        self.num_encoded = 0  # images run through the encoder (cache misses), for tests and stats
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(vocab_size)
        self.graphs = None  # worker.cuda_graphs.DecodeGraphs, set by the engine on CUDA

    @staticmethod
    def _pending_row(req: Request, prev: Launched | None) -> int:
        row = None if prev is None else prev.row_of.get(req.request_id)
        if row is None:
            raise RuntimeError(f"{req.request_id}: its input token is pending but no step in flight has it")
        return row

    def _prepare(self, batch: ScheduledBatch, prev: Launched | None = None):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        num_decodes = 0
        pending: list[int] = []  # per row: the row of prev.tokens holding its input, or -1
        for s in batch.seqs:
            req = s.request
            bt = req.block_ids
            if s.num_tokens == 1:
                num_decodes += 1
                p = s.start
                ids.append(req.all_token_ids[p])
                if ids[-1] == PENDING_TOKEN:
                    pending += [-1] * (len(ids) - 1 - len(pending)) + [self._pending_row(req, prev)]
                pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
            else:
                r = range(s.start, s.start + s.num_tokens)
                ids.extend(req.all_token_ids[s.start : s.start + s.num_tokens])
                pos.extend(r)
                slots.extend(bt[p // bs] * bs + p % bs for p in r)
            if s.sample:
                sample_idx.append(len(ids) - 1)
        dev = self.device
        attn = AttentionBatch(
            query_lens=[s.num_tokens for s in batch.seqs],
            context_lens=[s.start for s in batch.seqs],
            block_tables=[s.request.block_ids for s in batch.seqs],
            num_decodes=num_decodes,
            slot_mapping=to_device(torch.tensor(slots, dtype=torch.long), dev),
            block_size=bs,
            bidirectional=self._bidirectional_spans(batch),
        )
        meta = self.backend.plan(attn, dev)
        input_ids = to_device(torch.tensor(ids, dtype=torch.long), dev)
        if pending:
            pending += [-1] * (len(ids) - len(pending))
            input_ids = _take_pending(input_ids, to_device(torch.tensor(pending), dev), prev)
        if self.uses_mrope:
            positions = to_device(self._mrope_positions(batch), dev)
        else:
            positions = to_device(torch.tensor(pos, dtype=torch.long), dev)
        return input_ids, positions, meta, sample_idx

    def _bidirectional_spans(self, batch: ScheduledBatch) -> list[list[tuple[int, int]]] | None:
        """Per sequence, the image spans its chunk overlaps, for models whose image tokens attend both
        ways (Gemma 3); None when no chunk of the step touches one."""
        if not getattr(self.model, "mm_bidirectional", False):
            return None
        spans = [
            [
                (it.offset, it.end)
                for it in s.request.mm_items
                if it.offset < s.start + s.num_tokens and s.start < it.end
            ]
            for s in batch.seqs
        ]
        return spans if any(spans) else None

    def _mrope_positions(self, batch: ScheduledBatch) -> torch.Tensor:
        """[3, T]: prompt positions from the request's table; generated tokens at p + delta on all axes."""
        parts = []
        for s in batch.seqs:
            req = s.request
            a, b = s.start, s.start + s.num_tokens
            table = req.mrope_positions
            n_tab = 0 if table is None else table.shape[1]
            if a < n_tab:
                parts.append(table[:, a : min(b, n_tab)])
            lo = max(a, n_tab)
            if lo < b:
                parts.append(torch.arange(lo, b).add_(req.mrope_delta).expand(3, -1))
        return torch.cat(parts, dim=1)

    def _image_embeddings(self, batch: ScheduledBatch):
        """(destination rows, embeddings) for every prefill row inside an image span, or None."""
        wanted = []  # (request, item index, row of the chunk start, chunk start, chunk end)
        row = 0
        for s in batch.seqs:
            req = s.request
            a, b = s.start, s.start + s.num_tokens
            for idx, it in enumerate(req.mm_items):
                if it.offset < b and a < it.end:
                    wanted.append((req, idx, row, a, b))
            row += s.num_tokens
        if not wanted:
            return None
        self._encode_missing([(req, idx) for req, idx, *_ in wanted])
        dest, src = [], []
        for req, idx, row, a, b in wanted:
            it = req.mm_items[idx]
            emb = req.mm_embeds[idx]
            lo, hi = max(a, it.offset), min(b, it.end)
            if it.embed_index is None:
                dest.append(torch.arange(row + lo - a, row + hi - a))
                src.append(emb[lo - it.offset : hi - it.offset])
            else:
                ei = it.embed_index[lo - it.offset : hi - it.offset]
                keep = ei >= 0
                dest.append(torch.nonzero(keep).flatten() + (row + lo - a))
                src.append(emb[ei[keep].to(emb.device)])
            if b >= it.end:  # the prefill has passed this image: the request no longer needs it
                req.mm_embeds.pop(idx, None)
        rows = to_device(torch.cat(dest), self.device)
        return rows, torch.cat(src)

    def _encode_missing(self, needed) -> None:
        """Give every (request, item) its embeddings: already held, a vision-cache hit, or encoded now
        (all misses of the step in one encoder call, a repeated image encoded once)."""
        cache = self.encoder_cache
        todo: dict[str, list] = {}
        for req, idx in needed:
            if idx in req.mm_embeds:
                continue
            it = req.mm_items[idx]
            hit = None if it.content_hash in todo or cache is None else cache.get(it.content_hash)
            if hit is not None:
                req.mm_embeds[idx] = hit
            else:
                todo.setdefault(it.content_hash, []).append((req, idx))
        if not todo:
            return
        t0 = time.perf_counter()
        outs = self.model.encode_images([users[0][0].mm_items[users[0][1]].data for users in todo.values()])
        share = (time.perf_counter() - t0) / len(todo)
        self.num_encoded += len(todo)
        for (key, users), emb in zip(todo.items(), outs):
            expect = users[0][0].mm_items[users[0][1]].num_embeds
            if emb.shape[0] != expect:
                raise RuntimeError(f"the encoder gave {emb.shape[0]} embeddings; the image needs {expect}")
            if cache is not None:
                cache.put(key, emb)
            for req, idx in users:
                req.mm_embeds[idx] = emb
                req.encoder_time_s += share / len(users)

    def _graph_decode(self, batch: ScheduledBatch, prev: Launched | None) -> torch.Tensor | None:
        """Logits through a CUDA graph when every row is a plain decode (a generated token, so no image
        rows and no bidirectional spans) and the graphs cover the batch; else None."""
        seqs = batch.seqs
        if not self.graphs.fits(len(seqs), max(s.start for s in seqs) + 1):
            return None
        ids, pos, rope, pending = [], [], [], []
        for s in seqs:
            req = s.request
            p = s.start
            if s.num_tokens != 1 or p < len(req.prompt_token_ids):
                return None
            tok = req.all_token_ids[p]
            ids.append(tok)
            pending.append(self._pending_row(req, prev) if tok == PENDING_TOKEN else -1)
            pos.append(p)
            rope.append(p + req.mrope_delta)  # M-RoPE: generated tokens sit at p + delta on every axis
        host = to_device(torch.tensor([ids, rope, pending], dtype=torch.long), self.device)
        has_pending = any(r >= 0 for r in pending)
        input_ids = _take_pending(host[0], host[2], prev) if has_pending else host[0]
        attn = AttentionBatch(
            query_lens=[1] * len(seqs),
            context_lens=pos,
            block_tables=[s.request.block_ids for s in seqs],
            num_decodes=len(seqs),
            slot_mapping=None,  # the graph metadata derives slots from positions and block tables
            block_size=self.block_size,
        )
        return self.graphs.run(input_ids, host[1], attn)

    @torch.inference_mode()
    def compute_logits(
        self, batch: ScheduledBatch, all_tokens: bool = False, prev: Launched | None = None
    ) -> torch.Tensor:
        """Logits of the sampling rows (in batch order), or of every token when all_tokens (tests).
        `prev`: the step still in flight, whose tokens are the inputs of this step's pending rows."""
        if self.graphs is not None and not all_tokens:
            logits = self._graph_decode(batch, prev)
            if logits is not None:
                return logits
        input_ids, positions, meta, sample_idx = self._prepare(batch, prev)
        embeds, extra = None, {}
        if hasattr(self.model, "encode_images"):
            mm = self._image_embeddings(batch)
            if mm is not None:
                embeds = self.model.embed_input_ids(input_ids)
                rows, values = mm
                h = embeds.shape[1]
                embeds.index_copy_(0, rows, values[:, :h].to(embeds.dtype))
                if self.deepstack_layers:  # the rest of each row: one vector per early decoder layer
                    extra["deepstack"] = (rows, values[:, h:].unflatten(1, (self.deepstack_layers, h)))
        hidden = self.model(input_ids, positions, self.kv_caches, meta, embeds, **extra)
        if not all_tokens:
            hidden = hidden[to_device(torch.tensor(sample_idx, dtype=torch.long), self.device)]
        return self.model.compute_logits(hidden)

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: Launched | None = None) -> Launched:
        """Queue the step's forward pass and sampling on the device; no wait for the device unless a row
        asks for logprobs. The sampled tokens start their copy to the host."""
        sampling = [s.request for s in batch.seqs if s.sample]
        logits = self.compute_logits(batch, prev=prev)
        if not sampling:
            return Launched(batch, [])
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids) for r in sampling
        ]
        tokens, logprobs = self.sampler.sample(logits, rows)
        host, event = tokens, None
        if tokens.is_cuda:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        row_of = {r.request_id: i for i, r in enumerate(sampling)}
        return Launched(batch, sampling, tokens, host, event, logprobs, row_of)

    def collect(self, launched: Launched) -> RunnerOutput:
        """Wait for a launched step's tokens."""
        out = RunnerOutput()
        if not launched.requests:
            return out
        if launched.event is not None:
            launched.event.synchronize()
        for req, tok, lp in zip(launched.requests, launched.host.tolist(), launched.logprobs):
            out.sampled[req.request_id] = tok
            if lp is not None:
                out.logprobs[req.request_id] = lp
        return out


def _take_pending(input_ids: torch.Tensor, rows: torch.Tensor, prev: Launched) -> torch.Tensor:
    """input_ids with every row whose `rows` entry is >= 0 replaced by that row of prev.tokens (on the
    device: the step in flight has not told the host its tokens yet)."""
    return torch.where(rows >= 0, prev.tokens[rows.clamp(min=0)], input_ids)
