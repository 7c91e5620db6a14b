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
from typing import TYPE_CHECKING

from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import SchedulerConfig
from foveal.request import FinishReason, Request, RequestStatus
from foveal.sched import stops
from foveal.sched.batch import NewRequest, ScheduledBatch, ScheduledItem

if TYPE_CHECKING:
    from foveal.diffusion.driver import DiffusionDriver
    from foveal.lora.driver import LoRADriver

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
        lora: LoRADriver | None = None,
        diffusion: DiffusionDriver | None = None,
    ):
        if config.max_num_batched_tokens is None:
            raise ValueError("the scheduler needs a token budget: use SchedulerConfig.for_device(...)")
        self.config = config
        self.encoder_cache = encoder_cache
        self.atomic_mm_spans = atomic_mm_spans
        self.encoder_budget = config.max_encoder_tokens_per_step or config.max_num_batched_tokens
        self.kv = kv
        self.max_model_len = max_model_len
        self.lora = lora  # LoRA's driver (adapter slots, their cap per step), else None
        self.diffusion = diffusion  # a diffusion model's driver (plans its passes), else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._finished: list[str] = []  # ids finished since take_finished last ran (the teardown path)
        self._by_id: dict[str, Request] = {}  # unfinished requests

    # -- queue management ------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self.diffusion is not None:
            self.diffusion.admit(req)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)
        self._by_id[req.request_id] = req

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
        req.draft_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self._by_id.pop(req.request_id, None)
        self._finished.append(req.request_id)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._by_id.get(request_id)

    def take_finished(self) -> list[str]:
        """Ids of the requests that finished since the last call (done, aborted or failed): the
        engine's one teardown path hands them to the runner and every driver."""
        ids, self._finished = self._finished, []
        return ids

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        # decodes first, then prefill chunks: the layout attention backends expect
        decodes, chunks = batch.items, []
        budget = self.config.max_num_batched_tokens
        self._enc_left = self.encoder_budget
        bs = self.kv.block_size
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.ends_after_pending:  # its last token is in flight: nothing more to compute
                i += 1
                continue
            if self.diffusion is not None:  # a denoising pass, a commit or a prompt chunk of whole blocks
                plan = self.diffusion.plan(req, budget, req.num_computed_tokens)
                if plan is None:
                    i += 1
                    continue
                if not self._make_room(req, len(plan[1]), batch):
                    break  # req itself was preempted; everything after it was too
                self.kv.allocate(req, len(plan[1]))
                self._add_diffusion(req, plan, decodes, chunks)
                budget -= len(plan[1])
                i += 1
                continue
            start = req.num_computed_tokens
            if req.draft_ids:
                if self._verify(req, decodes, budget):
                    budget -= decodes[-1].num_tokens
                    i += 1
                    continue
                req.draft_ids = []  # no room for them this step: a plain decode
            if req.num_tokens - start == 1 and start < len(req.block_ids) * bs and not req.mm_items:
                # the common case, a decode whose slot is already allocated: no allocation to check
                known = req.all_token_ids
                fed = (known[start],) if start < len(known) else ()  # () while its token is in flight
                decodes.append(ScheduledItem(req.request_id, start, fed, req.block_table, 1, 1 - len(fed)))
                budget -= 1
                i += 1
                continue
            n = self._chunk(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:  # its next image must wait for encoder budget
                i += 1
                continue
            if not self._make_room(req, n, batch):
                break  # req itself was preempted; everything after it was too
            self.kv.allocate(req, n)
            item = self._item(req, n)
            (decodes if item.is_decode else chunks).append(item)
            self._spend_encoder(req, n)
            budget -= n
            i += 1
        # Waiting requests only when nobody was preempted this step (they would just evict each other).
        # A request whose adapter would be one more than the slots hold waits, the ones behind it go on.
        cap = self.lora.cap(self.running) if self.lora is not None else None
        passed: list[Request] = []
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            if cap is not None and not cap.admits(req):
                passed.append(self.waiting.popleft())
                continue
            # the longest prefix already in the cache: not recomputed (an embedding pools every position)
            cached = self.kv.find_cached(req) if req.pooling is None else []
            if self.diffusion is not None:
                cached = self.diffusion.usable_prefix(req, cached, self.kv.block_size)
            start = req.num_computed_tokens + len(cached) * self.kv.block_size
            plan = None
            if self.diffusion is not None:
                plan = self.diffusion.plan(req, budget, start)
                n = 0 if plan is None else len(plan[1])
            else:
                n = self._chunk(req, min(req.num_tokens - start, budget), start)
            if n == 0 or not self.kv.can_allocate(req, n, cached):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if cap is not None:
                cap.add(req)
            self.kv.allocate(req, n, cached)
            if req.num_preemptions == 0 and not req.output_token_ids:
                req.num_cached_tokens = start
                self.kv.record_lookup(req, start)
            if not req.announced:  # the runner's copy goes with its first step (kept across preemption)
                req.announced = True
                batch.new_requests.append(_new_request(req))
            if plan is not None:
                self._add_diffusion(req, plan, decodes, chunks)
            else:
                item = self._item(req, n)
                (decodes if item.is_decode else chunks).append(item)
            self._spend_encoder(req, n)
            budget -= n
        self.waiting.extendleft(reversed(passed))
        decodes += chunks
        if self.lora is not None and batch.items:
            batch.lora = self.lora.plan(batch.items, self._by_id)
        return batch

    def _verify(self, req: Request, decodes: list[ScheduledItem], budget: int) -> bool:
        """Schedule a decode with the request's drafts (1 + k tokens) if the budget and the pool allow
        it without preempting anyone; False leaves everything unchanged."""
        n = 1 + len(req.draft_ids)
        if req.num_pending or req.num_tokens - req.num_computed_tokens != 1 or n > budget:
            return False
        if not self.kv.can_allocate(req, n):
            return False
        self.kv.allocate(req, n)
        decodes.append(self._item(req, 1))
        return True

    def _make_room(self, req: Request, n: int, batch: ScheduledBatch) -> bool:
        """Preempt the most recently arrived running requests until the pool can hold req's next n
        tokens; False when req itself had to go (so did every request after it)."""
        while not self.kv.can_allocate(req, n):
            victim = self.running[-1]
            self._preempt(victim, batch)
            if victim is req:
                return False
        return True

    def _add_diffusion(self, req: Request, plan, decodes: list, chunks: list) -> None:
        item, with_decodes = self.diffusion.item(req, plan)
        (decodes if with_decodes else chunks).append(item)

    def _needs_encoder(self, req: Request, idx: int) -> bool:
        it = req.mm_items[idx]
        if it.offset < req.num_computed_tokens < it.end:
            return False  # an earlier chunk entered the span: the runner holds its embeddings
        return self.encoder_cache is None or it.content_hash not in self.encoder_cache

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

    def _item(self, req: Request, n: int) -> ScheduledItem:
        """The next n positions of the request (its drafts after them, if any)."""
        start = req.num_computed_tokens
        known = req.all_token_ids
        end = min(start + n, len(known))
        drafts = req.draft_ids
        reaches_end = start + n == req.num_tokens
        return ScheduledItem(
            req.request_id,
            start,
            tuple(known[start:end]) + tuple(drafts),
            req.block_table,
            num_logits=(1 + len(drafts)) if reaches_end and req.pooling is None else 0,
            num_pending=start + n - end,
            num_drafts=len(drafts),
        )

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

    def update(self, batch: ScheduledBatch, sampled: dict[str, list[int]]) -> list[Request]:
        """advance() then resolve(): a step whose tokens are already known.

        Returns the requests that finished in this step (already freed).
        """
        self.advance(batch)
        return self.resolve(batch, sampled)

    def advance(self, batch: ScheduledBatch) -> None:
        """The step was launched: its tokens count as computed, and each plain sampling row gets a
        pending token, so the next step can be scheduled before this one's tokens reach the host
        (overlap). A pending token that reaches a length limit ends the request's scheduling. A verify
        row's count of new tokens is known only when it resolves: nothing is pending for it."""
        for s in batch.items:
            req = self._live(s)
            if req is None:
                continue
            req.num_computed_tokens = s.start + s.num_tokens
            req.draft_ids = []
            if s.num_logits and s.committed:
                req.append_pending()
                req.ends_after_pending = stops.length_reached(
                    req, req.num_output_tokens, req.num_tokens, self.max_model_len
                )

    def _live(self, s: ScheduledItem) -> Request | None:
        req = self._by_id.get(s.request_id)
        return req if req is not None and req.status is RequestStatus.RUNNING else None

    def resolve(
        self, batch: ScheduledBatch, sampled: dict[str, list[int]], confidence: dict | None = None
    ) -> list[Request]:
        """The step's tokens arrived: fill the pending tokens (a verify row: rewind its rejected drafts
        and append what it accepted), publish full blocks, apply token-level stop rules, truncating a
        run of several tokens at the first stop. `sampled` maps a request id to its new tokens, and
        comes back with each run cut where its request stopped. Returns the requests that finished
        (already freed; tokens still in flight dropped). A diffusion model's pass comes with each row's
        `confidence`; its request's tokens become the ones that turned final (maybe none)."""
        finished = []
        for s in batch.items:
            req = self._by_id.get(s.request_id)
            if req is None or req.is_finished or not s.num_logits:
                if req is not None and req.status is RequestStatus.RUNNING:
                    if self.diffusion is not None:
                        self.diffusion.written(req, s)
                    self.kv.publish(req)
                continue
            if s.denoise >= 0:
                reason = self._denoised(req, s, sampled, confidence or {})
                if reason is not None:
                    self.finish(req, reason)
                    finished.append(req)
                continue
            toks = sampled[s.request_id]
            if not s.committed:  # keep the K/V of the fed token and the accepted drafts only
                kept = s.start + 1 + (len(toks) - 1)
                if req.status is RequestStatus.RUNNING:
                    self.kv.rewind(req, kept)
            reason = None
            for j, tok in enumerate(toks):
                num_out = req.fill_pending(tok) if s.committed else self._append(req, tok)
                reason = stops.token_stop(req, tok, num_out, self.max_model_len)
                if reason is not None:
                    del toks[j + 1 :]
                    break
            if req.status is RequestStatus.RUNNING:
                self.kv.publish(req)  # after the fill: a published block never holds an unknown token
            if reason is not None:
                self.finish(req, reason)
                finished.append(req)
        return finished

    def _denoised(
        self, req: Request, s: ScheduledItem, sampled: dict, confidence: dict
    ) -> FinishReason | None:
        """A denoising pass's rows reached the host: the window's K/V goes (provisional), the canvas
        takes the chosen tokens (DiffusionDriver.denoised), and the tokens that turned final become
        the request's new output (`sampled` then holds those), cut at a stop."""
        final, keep = self.diffusion.denoised(req, sampled[s.request_id], confidence[s.request_id])
        if req.status is RequestStatus.RUNNING:
            self.kv.rewind(req, keep)
            self.kv.publish(req)
        new: list[int] = []
        sampled[s.request_id] = new
        for tok in final:
            new.append(tok)
            reason = stops.token_stop(req, tok, self._append(req, tok), self.max_model_len)
            if reason is not None:
                return reason
        return None

    @staticmethod
    def _append(req: Request, tok: int) -> int:
        req.append_token(tok)
        return req.num_output_tokens


def _new_request(req: Request) -> NewRequest:
    return NewRequest(
        req.request_id,
        tuple(req.prompt_token_ids),
        req.params,
        req.eos_token_ids,
        tuple(req.mm_items),
        req.rope,
        None if req.diffusion is None else req.diffusion.runner_view,
        req.pooling,
    )
