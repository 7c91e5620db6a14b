"""Runs one scheduled step: builds the flat input tensors, plans attention once, encodes the images
the step's prefill chunks reach (vision cache first), runs the model, computes logits only for the
positions that give them, samples each row with its own parameters and verifies drafts.

    items:   [d0 | d1 | v2 v2 v2 | p0 p0 p0 p0 | p1 p1]   decodes and verify runs first, then prefill
    logits:    x    x    x  x  x              x       x    (verify: every position; prefill: the last)
    images:                     [i  i]                     rows of p0 inside an image span take its
                                                           embeddings (DeepStack: more at early layers)

The runner keeps its own state per request (the batch's `NewRequest`, dropped when the id comes back
in `finished`): sampling parameters, the tokens it has produced (penalties read them), image
embeddings not yet passed, and a row of the device token buffer. That buffer holds the tokens each
request's latest step sampled, so a step launched before the previous one's tokens reach the host
(async scheduling) reads its pending inputs there, on the device.

An image's embeddings stay with the runner until the prefill passes the end of its span, so a chunk
boundary inside the span neither re-encodes nor depends on the cache keeping the entry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from foveal.attention.base import AttentionBatch
from foveal.device import to_device
from foveal.models.base import StepContext
from foveal.request import TokenLogprobs
from foveal.sample.sampler import PendingLogprobs, Sampler, SamplingRow
from foveal.sched.batch import DEVICE_DRAFT, NewRequest, ScheduledBatch, ScheduledItem
from foveal.speculative.proposer import VerifyRun
from foveal.speculative.rejection import verify
from foveal.worker.rows import StepRows, build_rows, staged_drafts

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunnerOutput:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # request id -> its new tokens, in order
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    encoder_time_s: dict[str, float] = field(default_factory=dict)  # vision-encoder time spent per request
    # hidden-state drafters (`ModelRunner.tap`): per request, (position of the first row, [n, H]) for
    # the step's rows whose input tokens are confirmed (a verify row's: up to its last accepted draft)
    hidden: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # diffusion models: per request, each denoising row's confidence (its token is in `tokens`)
    confidence: dict[str, list[float]] = field(default_factory=dict)
    # embedding requests whose prompt was finished: the pooled hidden state (float32, on the host)
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class _Held:
    """What the runner keeps of one request between steps."""

    req: NewRequest
    slot: int  # its row of the device token buffer
    shift: int = 0  # generated tokens' position past their index (the model's `position_shift`)
    output_token_ids: list[int] = field(default_factory=list)  # produced and seen by collect()
    mm_embeds: dict[int, Any] = field(default_factory=dict)  # image index -> embeddings, until passed
    pool_sum: torch.Tensor | None = None  # an embedding request's (mean pooling) hidden-state sum so far
    counted: bool = False  # its penalties' device history (sampler.history) is started and current


@dataclass(slots=True)
class Launched:
    """A step whose device work is queued: its tokens reach the host with `collect`."""

    batch: ScheduledBatch
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (request id, first row, rows)
    tokens: torch.Tensor | None = None  # [rows] on the device: each logits row's token
    accepted: torch.Tensor | None = None  # [len(rows)]: drafts accepted per item (verify steps)
    host: torch.Tensor | None = None  # tokens (then accepted) on the host, valid once `event` is done
    event: object = None  # torch.cuda.Event, or None (CPU: already done)
    logprobs: PendingLogprobs | None = None  # the logits rows' logprobs (sampler.py)
    encoder_time_s: dict[str, float] = field(default_factory=dict)
    logits: torch.Tensor | None = None  # until sampled: the forward pass's logits rows
    tapped: torch.Tensor | None = None  # [T, H]: every fed token's state for a hidden-state drafter
    denoised: bool = False  # a diffusion step: `host` is [2, rows] (tokens, confidences) in float64
    pooled: dict[str, torch.Tensor] = field(default_factory=dict)  # embedding requests done this step
    handed: frozenset = frozenset()  # items whose tapped rows went out at launch (prompt_hidden)


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
        max_tokens_per_row: int = 1,
        graphs=None,
        lora=None,
        tap=None,
        diffusion=None,
    ):
        self.model = model
        self.encoder_cache = encoder_cache
        self.num_encoded = 0  # images run through the encoder (cache misses), for tests and stats
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(vocab_size, self.device)
        self.diffusion = diffusion  # a diffusion model's rows and passes (diffusion/passes.py), or None
        self.graphs = graphs  # decode-step graphs (worker/cuda_graphs.py, cpu_graphs.py), or None: eager
        self.lora = lora  # foveal.lora.slots.LoRASlots when adapters are enabled
        # a hidden-state drafter's tap (speculative/hidden.py): `tap_layers` the model reports,
        # `fuse(aux, final)` -> [T, H] kept per fed token; None: nothing is kept
        self.tap = tap
        self._tapped: torch.Tensor | None = None  # the latest forward pass's, until launch takes it
        self._num_pooling = 0  # held embedding requests: a step pools their rows' hidden states
        self._pooled: dict[str, torch.Tensor] = {}  # the latest forward pass's, until launch takes it
        self._held: dict[str, _Held] = {}
        self._free_slots: list[int] = []
        # [requests, tokens one step may produce per row]: the latest sampled tokens of each request
        self.token_buffer = torch.zeros(0, max_tokens_per_row, dtype=torch.long, device=self.device)

    # -- per-request state ----------------------------------------------------------------------------
    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests (idempotent). A step still in flight may be collected after it."""
        for rid in request_ids:
            held = self._held.pop(rid, None)
            if held is not None:
                self._free_slots.append(held.slot)
                self._num_pooling -= held.req.pooling is not None

    def _admit(self, batch: ScheduledBatch) -> None:
        """Learn the batch's new requests (idempotent: a batch may be run twice)."""
        for new in batch.new_requests:
            if new.request_id not in self._held:
                shift = self.model.position_shift(new.rope)
                self._held[new.request_id] = _Held(new, self._slot(), shift)
                self._num_pooling += new.pooling is not None

    def _slot(self) -> int:
        if not self._free_slots:
            n, w = self.token_buffer.shape
            grow = torch.zeros(max(16, n), w, dtype=torch.long, device=self.device)
            self.token_buffer = torch.cat([self.token_buffer, grow])
            self._free_slots = list(range(self.token_buffer.shape[0] - 1, n - 1, -1))
        return self._free_slots.pop()

    @property
    def num_held(self) -> int:
        return len(self._held)

    @torch.inference_mode()
    def stage_drafts(self, request_ids: list[str], counts: list[int], flat: torch.Tensor) -> list[bool]:
        """Put drafts computed on the device where a verify step reads them, unread by the host:
        request i's `counts[i]` drafts (flat, row after row) at rows 1 .. k of its token-buffer slot,
        in one device copy. Per request whether it was staged (False: not held here, or more drafts
        than a row holds; its drafts must come as ids)."""
        width = self.token_buffer.shape[1]
        dst: list[int] = []
        src: list[int] = []
        staged, at = [], 0
        for rid, c in zip(request_ids, counts):
            held = self._held.get(rid)
            ok = held is not None and c < width
            if ok and c:
                dst.extend(range(held.slot * width + 1, held.slot * width + 1 + c))
                src.extend(range(at, at + c))
            staged.append(ok)
            at += c
        if dst:
            flat = flat.to(self.device, non_blocking=True)
            if len(src) < flat.shape[0]:  # some rows' drafts are not staged
                flat = flat[to_device(torch.tensor(src, dtype=torch.long), self.device)]
            dst_d = to_device(torch.tensor(dst, dtype=torch.long), self.device)
            self.token_buffer.view(-1).index_copy_(0, dst_d, flat)
        return staged

    def _key_limits(self, s: ScheduledItem) -> list[int] | None:
        return self.diffusion.key_limits(s, self._held[s.request_id].req.diffusion)

    def _with_pending(self, input_ids: torch.Tensor, src: list[int]) -> torch.Tensor:
        """input_ids with every position whose `src` entry is >= 0 replaced by that flat index of the
        token buffer (the tokens of a step the host has not seen yet)."""
        idx = to_device(torch.tensor(src, dtype=torch.long), self.device)
        return torch.where(idx >= 0, self.token_buffer.view(-1)[idx.clamp(min=0)], input_ids)

    def _rows(self, batch: ScheduledBatch) -> StepRows:
        limits = self._key_limits if self.diffusion is not None else None
        return build_rows(batch.items, self._held, self.token_buffer.shape[1], self.block_size, limits)

    def _prepare(self, batch: ScheduledBatch, rows: StepRows):
        dev = self.device
        attn = AttentionBatch(
            query_lens=rows.query_lens,
            context_lens=rows.context_lens,
            block_tables=rows.block_tables,
            num_decodes=rows.num_decodes,
            slot_mapping=to_device(torch.tensor(rows.slots, dtype=torch.long), dev),
            block_size=self.block_size,
            bidirectional=self._bidirectional_spans(batch),
        )
        meta = self.backend.plan(attn, dev)
        input_ids = to_device(torch.tensor(rows.ids, dtype=torch.long), dev)
        if rows.any_pending:
            input_ids = self._with_pending(input_ids, rows.pending)
        if self.model.uses_mrope:
            spans = [
                (s.start, s.start + s.num_tokens, self._held[s.request_id].req.rope) for s in batch.items
            ]
            positions = to_device(self.model.rope_positions(spans), dev)
        else:
            positions = to_device(torch.tensor(rows.positions, dtype=torch.long), dev)
        return input_ids, positions, meta

    @staticmethod
    def _lora_groups(batch: ScheduledBatch) -> list[tuple[int, int]] | None:
        """Per item (its adapter's slot, its rows) when some row of the step runs an adapter, else None
        (the slots are the scheduling side's choice: foveal/lora/driver.py)."""
        if batch.lora is None:
            return None
        return list(zip(batch.lora.slots, (s.num_tokens for s in batch.items)))

    def _bidirectional_spans(self, batch: ScheduledBatch) -> list[list[tuple[int, int]]] | None:
        """Per attention row, the image spans its chunk overlaps, for models whose image tokens attend
        both ways (Gemma 3); None when no chunk of the step touches one. A decode row needs none: a
        single query token sees every earlier token anyway."""
        if not self.model.mm_bidirectional and self.diffusion is None:
            return None
        spans: list[list[tuple[int, int]]] = []
        for s in batch.items:
            if s.is_decode:
                spans += [[] for _ in range(s.num_tokens)]
                continue
            a, b = s.start, s.start + s.num_tokens
            req = self._held[s.request_id].req
            if self.diffusion is not None:  # its attention shape (NewRequest.diffusion)
                spans += self.diffusion.spans(s, req.diffusion)
                continue
            spans.append([(it.offset, it.end) for it in req.mm_items if it.offset < b and a < it.end])
        return spans if any(spans) else None

    def _image_embeddings(self, batch: ScheduledBatch, spent: dict[str, float]):
        """(destination rows, embeddings) for every prefill row inside an image span, or None."""
        wanted = []  # (held, item index, row of the chunk start, chunk start, chunk end)
        row = 0
        for s in batch.items:
            held = self._held[s.request_id]
            a, b = s.start, s.start + s.num_tokens
            for idx, it in enumerate(held.req.mm_items):
                if it.offset < b and a < it.end:
                    wanted.append((held, idx, row, a, b))
            row += s.num_tokens
        if not wanted:
            return None
        self._encode_missing([(held, idx) for held, idx, *_ in wanted], spent)
        dest, src = [], []
        for held, idx, row, a, b in wanted:
            it = held.req.mm_items[idx]
            emb = held.mm_embeds[idx]
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
                held.mm_embeds.pop(idx, None)
        rows = to_device(torch.cat(dest), self.device)
        return rows, torch.cat(src)

    def _encode_missing(self, needed: list[tuple[_Held, int]], spent: dict[str, float]) -> None:
        """Give every (request, item) its embeddings: already held, a vision-cache hit, or encoded now
        (all misses of the step in one encoder call, a repeated image encoded once)."""
        cache = self.encoder_cache
        todo: dict[str, list[tuple[_Held, int]]] = {}
        for held, idx in needed:
            if idx in held.mm_embeds:
                continue
            it = held.req.mm_items[idx]
            hit = None if it.content_hash in todo or cache is None else cache.get(it.content_hash)
            if hit is not None:
                held.mm_embeds[idx] = hit
            else:
                todo.setdefault(it.content_hash, []).append((held, idx))
        if not todo:
            return
        t0 = time.perf_counter()
        outs = self.model.encode_images([u[0][0].req.mm_items[u[0][1]].data for u in todo.values()])
        share = (time.perf_counter() - t0) / len(todo)
        self.num_encoded += len(todo)
        for (key, users), emb in zip(todo.items(), outs):
            expect = users[0][0].req.mm_items[users[0][1]].num_embeds
            if emb.shape[0] != expect:
                raise RuntimeError(f"the encoder gave {emb.shape[0]} embeddings; the image needs {expect}")
            if cache is not None:
                cache.put(key, emb)
            for held, idx in users:
                held.mm_embeds[idx] = emb
                rid = held.req.request_id
                spent[rid] = spent.get(rid, 0.0) + share / len(users)

    def _graph_decode(self, batch: ScheduledBatch, rows: StepRows) -> torch.Tensor | None:
        """Logits through a decode-step graph when every row is a one-token query of a generated token
        (so no image rows and no bidirectional spans) and the graphs cover the batch's rows; else None."""
        items = batch.items
        if not rows.short_queries or not self.graphs.fits(
            rows.num_rows, max(s.start + s.num_tokens for s in items)
        ):
            return None
        # ids, rotary positions and (where some are in flight) token-buffer sources in one copy
        host_rows = [rows.ids, rows.rope, rows.pending] if rows.any_pending else [rows.ids, rows.rope]
        host = to_device(torch.tensor(host_rows, dtype=torch.long), self.device)
        input_ids = host[0]
        if rows.any_pending:
            input_ids = torch.where(host[2] >= 0, self.token_buffer.view(-1)[host[2].clamp(min=0)], host[0])
        attn = AttentionBatch(
            query_lens=rows.query_lens,
            context_lens=rows.context_lens,
            block_tables=rows.block_tables,
            num_decodes=rows.num_rows,
            # the graph metadata derives slots from contexts and block tables, or takes them as given
            # (a block diffusion model's rows: their keys are not at their contexts)
            slot_mapping=torch.tensor(rows.slots, dtype=torch.long) if rows.block_diffusion else None,
            block_size=self.block_size,
        )
        shares = getattr(self.backend, "shares_prefixes", None)  # Triton's shared-prefix decode
        shared = shares is not None and shares(attn)
        if shared and not self.graphs.takes_shared(rows.num_rows):
            return None  # eagerly: no graph of that size was captured with the shared-prefix kernel
        logits = self.graphs.run(input_ids, host[1], attn, self._lora_groups(batch), shared=shared)
        if self.tap is not None:  # the graphs' static buffer: the next replay overwrites it
            self._tapped = self.graphs.tapped[: rows.num_rows].clone()
        if len(rows.logits_rows) < rows.num_rows:  # a block diffusion item's last num_logits rows
            logits = logits[to_device(torch.tensor(rows.logits_rows, dtype=torch.long), self.device)]
        return logits

    @torch.inference_mode()
    def compute_logits(
        self, batch: ScheduledBatch, all_tokens: bool = False, spent: dict[str, float] | None = None
    ) -> torch.Tensor:
        """Logits of the positions that give them (in batch order), or of every token when all_tokens
        (tests). `spent` collects vision-encoder time per request."""
        self._admit(batch)
        if batch.lora is not None:  # the step's adapters not yet in their slots
            self.lora.load(batch.lora.loads)
        rows = self._rows(batch)
        if self.graphs is not None and not all_tokens:
            logits = self._graph_decode(batch, rows)
            if logits is not None:
                return logits
        input_ids, positions, meta = self._prepare(batch, rows)
        ctx = StepContext(positions, self.kv_caches, meta)
        groups = self._lora_groups(batch)
        if groups is not None:
            from foveal.lora.slots import group_rows

            packed = group_rows(groups, self.lora.num_slots + 1)
            ctx.lora = self.lora.batch(to_device(torch.tensor(packed), self.device), input_ids.shape[0])
        if self.tap is not None:
            ctx.aux_layers, ctx.aux = self.tap.tap_layers, []
        if self.model.is_multimodal:
            mm = self._image_embeddings(batch, {} if spent is None else spent)
            if mm is not None:
                embeds = ctx.inputs_embeds = self.model.embed_input_ids(input_ids)
                image_rows, values = mm
                h = embeds.shape[1]
                embeds.index_copy_(0, image_rows, values[:, :h].to(embeds.dtype))
                # DeepStack (Qwen3-VL): the rest of each row, one hidden-sized vector per early layer
                k = self.model.deepstack_layers
                if k:
                    ctx.deepstack = (image_rows, values[:, h:].unflatten(1, (k, h)))
        hidden = self.model(input_ids, ctx)
        if self.tap is not None:
            self._tapped = self.tap.fuse(ctx.aux, hidden)
        if self._num_pooling:
            self._pool(batch, hidden)
        if not all_tokens:
            hidden = hidden[to_device(torch.tensor(rows.logits_rows, dtype=torch.long), self.device)]
        return self.model.compute_logits(hidden)

    def _pool(self, batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Embedding requests: fold each item's rows of (final-norm) hidden states into its pooling; an
        item that completes the prompt leaves the pooled vector in `_pooled`. A chunk from position 0
        starts over (a preempted request is recomputed)."""
        row = 0
        for s in batch.items:
            held, n = self._held[s.request_id], s.num_tokens
            how = held.req.pooling
            if how is not None:
                rows = hidden[row : row + n].float()
                if how == "mean":
                    part = rows.sum(0)
                    held.pool_sum = part if s.start == 0 or held.pool_sum is None else held.pool_sum + part
                if s.start + n == len(held.req.prompt_token_ids):
                    pooled = rows[-1] if how == "last" else held.pool_sum / (s.start + n)
                    self._pooled[s.request_id] = pooled
                    held.pool_sum = None
            row += n

    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        return self.collect(self.launch(batch))

    def _sampling_rows(self, s: ScheduledItem, held: _Held) -> list[SamplingRow]:
        """One row per logits position of the item; a verify run's row j sees drafts 1..j as output."""
        req = held.req
        first = s.start + s.num_tokens - s.num_logits + 1 - len(req.prompt_token_ids)  # its output index
        out = held.output_token_ids
        penalties = req.params.needs_penalties
        if not s.num_drafts:
            if penalties and not held.counted:  # the output list is current here (see below)
                rep = req.params.repetition_penalty != 1.0
                self.sampler.history.start(held.slot, req.prompt_token_ids, out, rep)
                held.counted = True
            slot = held.slot if penalties else None
            return [SamplingRow(req.params, req.prompt_token_ids, out, req.eos_token_ids, first, slot)]
        # a verify run counts its drafts from the host lists (current: speculation does not overlap
        # steps), and the device history is started again at the next one-row step
        held.counted = False
        drafts = list(s.drafts)
        if penalties and drafts[0] == DEVICE_DRAFT:
            raise RuntimeError(f"{s.request_id}: penalties count the drafts; they were left on the device")
        return [
            SamplingRow(
                req.params,
                req.prompt_token_ids,
                out + drafts[:j] if penalties else out,
                req.eos_token_ids,
                first + j,
            )
            for j in range(s.num_logits)
        ]

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, sample: bool = True) -> Launched:
        """Queue the step's forward pass, then (`sample`, else a later `sample()`) its sampling and
        verification on the device; no wait for the device unless a row asks for logprobs. The
        tokens start their copy to the host."""
        spent: dict[str, float] = {}
        logits = self.compute_logits(batch, spent=spent)
        launched = Launched(batch, encoder_time_s=spent, logits=logits, tapped=self._tapped)
        launched.pooled, self._pooled = self._pooled, {}
        self._tapped = None
        if sample:
            self.sample(launched)
        return launched

    @torch.inference_mode()
    def sample(self, launched: Launched, masks=None) -> None:
        """Sample (and verify) a launched step's logits: per-row parameters, the grammar masks of its
        constrained rows (structured/driver.py: (masks, their logits rows) on the device, or None), the
        tokens into the buffer."""
        batch, logits, launched.logits = launched.batch, launched.logits, None
        if self.diffusion is not None:  # a diffusion model's denoising passes
            reqs = [self._held[s.request_id].req for s in batch.items]
            launched.rows, host = self.diffusion.sample(batch.items, reqs, logits, self.sampler)
            if host is not None:
                launched.denoised = True
                self._start_copy(launched, host)
            return
        rows: list[SamplingRow] = []
        drafts: list[int] = []  # per logits row: the draft it checks, -1 for an item's last row
        sources: list[int] = []  # per logits row: where a staged draft is in the token buffer, or -1
        width = self.token_buffer.shape[1]
        for s in batch.items:
            if not s.num_logits:
                continue
            launched.rows.append((s.request_id, len(rows), s.num_logits))
            rows += self._sampling_rows(s, self._held[s.request_id])
            if s.num_drafts:
                staged = staged_drafts(s, self._held[s.request_id].slot, width)
                if staged:
                    sources += [-1] * (len(drafts) - len(sources)) + list(staged)
                drafts += s.drafts
            drafts.append(-1)
        if not rows:
            return
        verifying = len(drafts) > len(launched.rows)
        if verifying:
            draft_ids = to_device(torch.tensor(drafts, dtype=torch.long), self.device)
            if sources:
                draft_ids = self._with_pending(draft_ids, sources + [-1] * (len(drafts) - len(sources)))
            tokens, launched.accepted = self._verify(logits, rows, launched.rows, draft_ids, masks)
        else:
            tokens, logprobs = self.sampler.sample(logits, rows, masks)
            launched.logprobs = logprobs
            # the buffer row of each request: what the next step reads if it is launched before these
            # tokens reach the host
            width = self.token_buffer.shape[1]
            flat = [self._held[rid].slot * width for rid, _, _ in launched.rows]
            self.token_buffer.view(-1).index_copy_(
                0, to_device(torch.tensor(flat, dtype=torch.long), self.device), tokens
            )
        launched.tokens = tokens
        self.sampler.count(rows, tokens)  # one-row items with penalties: their device history
        if verifying:
            launched.logprobs = self.sampler.logprobs(logits[:, : self.sampler.vocab_size], rows, tokens)
        accepted = launched.accepted
        self._start_copy(launched, tokens if accepted is None else torch.cat([tokens, accepted]))

    @staticmethod
    def _start_copy(launched: Launched, host: torch.Tensor) -> None:
        """Start the step's results on their way to the host (collect waits for `event`)."""
        if host.is_cuda:
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host, non_blocking=True)
            launched.event = torch.cuda.Event()
            launched.event.record()
            host = pinned
        launched.host = host

    def _verify(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        items: list[tuple[str, int, int]],
        drafts: torch.Tensor,
        masks=None,
    ):
        """Verify every item's drafts against the target's logits (an item without drafts is a k = 0
        verify: it just samples its one row). Returns (tokens per row, accepted drafts per item)."""
        x = self.sampler.filtered_logits(logits, rows, masks)
        ks = [n - 1 for _, _, n in items]
        firsts = [rows[first] for _, first, _ in items]
        return verify(
            x,
            drafts,
            ks,
            [r.params.greedy for r in firsts],
            [r.params.seed for r in firsts],
            [r.draw_index for r in firsts],
        )

    def collect(self, launched: Launched) -> RunnerOutput:
        """Wait for a launched step's tokens."""
        out = RunnerOutput(encoder_time_s=launched.encoder_time_s)
        out.pooled = {rid: v.cpu() for rid, v in launched.pooled.items()}
        if not launched.rows:
            if launched.tapped is not None:
                self._hidden_rows(launched, {}, out)
            return out
        if launched.event is not None:
            launched.event.synchronize()
        if launched.denoised:
            self.diffusion.collect(launched.host, launched.rows, out)
            return out
        host = launched.host.tolist()
        num_rows = launched.tokens.shape[0]
        logprobs = launched.logprobs.values() if launched.logprobs is not None else []
        kept: dict[str, int] = {}
        for i, (rid, first, _) in enumerate(launched.rows):
            keep = kept[rid] = 1 if launched.accepted is None else host[num_rows + i] + 1
            toks = host[first : first + keep]
            out.tokens[rid] = toks
            lps = logprobs[first : first + keep]
            if lps and lps[0] is not None:
                out.logprobs[rid] = lps
            held = self._held.get(rid)
            if held is not None:
                held.output_token_ids += toks
        if launched.tapped is not None:
            self._hidden_rows(launched, kept, out)
        return out

    @staticmethod
    def prompt_hidden(launched: Launched) -> dict[str, tuple[int, torch.Tensor]]:
        """The tapped rows of the step's prompt chunks, (first position, [n, H]) per request, handed
        out at launch: their input tokens are all known, so they are confirmed before the step runs
        (collect then reports only the other items' rows)."""
        out: dict[str, tuple[int, torch.Tensor]] = {}
        if launched.tapped is None:
            return out
        row = 0
        for s in launched.batch.items:
            n = s.num_tokens
            if not s.is_decode:
                out[s.request_id] = (s.start, launched.tapped[row : row + n])
            row += n
        launched.handed = frozenset(out)
        return out

    @staticmethod
    def verify_runs(launched: Launched) -> list[VerifyRun]:
        """The sampled step's verify runs (items with drafts): where their tapped states, tokens and
        accepted counts are, for a drafter that follows the step on the device."""
        if launched.accepted is None or launched.tapped is None:
            return []
        at = {rid: (first, i) for i, (rid, first, _) in enumerate(launched.rows)}
        runs, row = [], 0
        for s in launched.batch.items:
            if s.num_drafts and s.request_id in at:
                first, i = at[s.request_id]
                runs.append(VerifyRun(s.request_id, s.start, s.num_drafts, row, first, i))
            row += s.num_tokens
        return runs

    @staticmethod
    def _hidden_rows(launched: Launched, kept: dict[str, int], out: RunnerOutput) -> None:
        """out.hidden: each item's tapped rows whose input tokens are confirmed (a verify row's up to
        its last accepted draft: `kept` tokens came out of it, the first from its confirmed input),
        but for the items handed out at launch (prompt_hidden)."""
        row = 0
        for s in launched.batch.items:
            n = s.num_tokens
            if s.request_id not in launched.handed:
                valid = kept.get(s.request_id, n) if s.num_drafts else n
                out.hidden[s.request_id] = (s.start, launched.tapped[row : row + valid])
            row += n
