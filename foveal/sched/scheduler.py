"""Continuous-batching scheduler with one token budget per step.

Each step spends `max_num_batched_tokens`: first on running requests, in arrival order (one decode
token each, or the next chunk of an unfinished prefill), then on waiting requests (a prefill chunk
that fits what is left). So chunked prefill and decodes share steps, and a long prompt is split.

When the KV pool cannot hold a running request's next tokens, the most recently arrived running
request is preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed (prompt + tokens generated so far) later. A request that fits the pool alone can always
make progress, so there is no deadlock: the engine caps max_model_len to the pool's capacity.

Images: a prefill chunk that reaches an image not yet encoded (nor in the vision cache) spends encoder
budget (`max_encoder_tokens_per_step`, in embedding tokens); when the budget is gone the chunk stops
before that image's span (the first image of a step always passes, so progress is guaranteed). For
models whose image tokens attend both ways (`atomic_mm_spans`), a chunk never ends inside a span: it
stops before the span, or takes it whole when the span starts the chunk (even past the token budget).

The scheduler knows nothing about models or tokenizers; stop strings are the engine's business.
"""

from __future__ import annotations

import logging
from collections import deque

from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import SchedulerConfig
from foveal.request import FinishReason, Request, RequestStatus
from foveal.sched.batch import ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        *,
        encoder_cache=None,
        atomic_mm_spans: bool = False,
    ):
        if config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs a token budget: use SchedulerConfig.for_device(...)")
        self.config = config
        self.encoder_cache = encoder_cache
        self.atomic_mm_spans = atomic_mm_spans
        self.encoder_budget = config.max_encoder_tokens_per_step or config.max_num_batched_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # -- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End a request wherever it is and release its blocks (idempotent)."""
        if req.status is RequestStatus.FINISHED:
            return
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req)
        req.drop_pending()  # tokens of a step still in flight are not part of the output
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._enc_left = self.encoder_budget
        bs = self.kv.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_after_pending:  # its last token is in flight: nothing more to compute
                i += 1
                continue
            start = req.num_computed_tokens
            if req.num_tokens - start == 1 and start < len(req.block_ids) * bs and not req.mm_items:
                # the common case, a decode whose slot is already allocated: no allocation to check
                batch.seqs.append(ScheduledSeq(req, start, 1, True))
                budget -= 1
                i += 1
                continue
            n = self._chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # its next image must wait for encoder budget
                i += 1
                continue
            while not self.kv.can_allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted; everything after it was too
            self.kv.allocate(req, n)
            batch.seqs.append(self._seq(req, n))
            self._spend_encoder(req, n)
            budget -= n
            i += 1
        # Waiting requests only when nobody was preempted this step (they would just evict each other).
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            cached = self.kv.find_cached(req)  # the longest prefix already in the cache: not recomputed
            start = req.num_computed_tokens + len(cached) * self.kv.block_size
            n = self._chunk(req, min(req.num_tokens - start, budget), start)
            if n == 0 or not self.kv.can_allocate(req, n, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.allocate(req, n, cached)
            if req.num_preemptions == 0 and not req.output_token_ids:
                req.num_cached_tokens = start
                self.kv.record_lookup(req, start)
            batch.seqs.append(self._seq(req, n))
            self._spend_encoder(req, n)
            budget -= n
        # Decodes first, then prefill chunks: the layout attention backends expect.
        batch.seqs.sort(key=lambda s: s.num_tokens != 1)
        return batch

    def _needs_encoder(self, req: Request, idx: int) -> bool:
        if idx in req.mm_embeds:
            return False
        return self.encoder_cache is None or req.mm_items[idx].content_hash not in self.encoder_cache

    def _chunk(self, req: Request, n: int, start: int | None = None) -> int:
        """Shorten (or, for an atomic span at the chunk start, lengthen) a chunk of n tokens for images."""
        if not req.mm_items or n == 0:
            return n
        if start is None:
            start = req.num_computed_tokens
        end = start + n
        enc_left = self._enc_left
        for idx, it in enumerate(req.mm_items):
            if it.end <= start:
                continue
            if it.offset >= end:
                break
            if self._needs_encoder(req, idx):
                fresh = enc_left == self.encoder_budget  # nothing encoded yet this step: always allowed
                if it.num_embeds > enc_left and not fresh:
                    return max(0, it.offset - start) if it.offset > start else 0
                enc_left -= it.num_embeds
            if self.atomic_mm_spans and end < it.end:
                return it.offset - start if it.offset > start else it.end - start
        return end - start

    def _spend_encoder(self, req: Request, n: int) -> None:
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        for idx, it in enumerate(req.mm_items):
            if it.offset < end and start < it.end and self._needs_encoder(req, idx):
                self._enc_left -= it.num_embeds

    def _seq(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        return ScheduledSeq(req, start, n, sample=start + n == req.num_tokens)

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        batch.preempted.append(req.request_id)
        self.num_preemptions += 1
        log.info(
            "%s preempted (recompute later); %d free blocks", req.request_id, self.kv.pool.num_free_blocks
        )

    def update(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """advance() then resolve(): a step whose tokens are already known.

        Returns the requests that finished in this step (already freed).
        """
        self.advance(batch)
        return self.resolve(batch, sampled)

    def advance(self, batch: ScheduledBatch) -> None:
        """The step was launched: its tokens count as computed, and each sampling row gets a pending
        token, so the next step can be scheduled before this one's tokens reach the host (overlap).
        A pending token that reaches a length limit ends the request's scheduling."""
        for s in batch.seqs:
            req = s.request
            if req.status is not RequestStatus.RUNNING:
                continue  # finished or aborted since it was scheduled
            req.num_computed_tokens = s.start + s.num_tokens
            if s.sample:
                req.append_pending()
                req.ends_after_pending = self._length_stop(req, req.num_output_tokens, req.num_tokens)

    def resolve(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """The step's tokens arrived: fill the pending tokens, publish full blocks, apply token-level stop
        rules. Returns the requests that finished (already freed; tokens still in flight dropped)."""
        finished = []
        for s in batch.seqs:
            req = s.request
            if req.is_finished:
                continue  # finished or aborted while the step ran
            tok = None
            if s.sample:
                tok = sampled[req.request_id]
                num_out = req.fill_pending(tok)
            if req.status is RequestStatus.RUNNING:
                self.kv.publish(req)  # after the fill: a published block never holds a pending token
            if tok is None:
                continue
            reason = self.check_stop(req, tok, num_out)
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def check_stop(self, req: Request, tok: int, num_out: int | None = None) -> FinishReason | None:
        """Why the request ends at `tok`, its num_out-th output token (default: the last one)."""
        p = req.params
        if num_out is None:
            num_out = req.num_output_tokens
        if num_out >= p.min_tokens:
            if (tok in req.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                return FinishReason.STOP
        if self._length_stop(req, num_out, req.num_prompt_tokens + num_out):
            return FinishReason.LENGTH
        return None

    def _length_stop(self, req: Request, num_out: int, num_tokens: int) -> bool:
        p = req.params
        return (p.max_tokens is not None and num_out >= p.max_tokens) or num_tokens >= self.max_model_len
