"""The engine: one object that owns the model, the KV pool, the scheduler and every request's state,
and advances them all by one `step()`. It is single-threaded by design: EngineLoop owns the thread
that calls it. It admits only processed requests (`EngineRequest`, made by the InputProcessor on the
caller's side); `engine/factory.py` builds it from its parts.

A failure that belongs to one request (detokenizer, stop matching) finishes that request with an
error delta; a failed forward pass aborts only the requests in that batch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import EngineConfig
from foveal.engine.detokenizer import IncrementalDetokenizer
from foveal.engine.input_processor import EngineInfo
from foveal.metrics import StepReport
from foveal.request import EngineRequest, FinishReason, Request, RequestStatus, TokenDelta, TokenLogprobs
from foveal.sched import stops
from foveal.sched.scheduler import Scheduler

if TYPE_CHECKING:
    from foveal.speculative.driver import SpeculationDriver
    from foveal.structured.driver import GuideDriver

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Tracked:
    req: Request
    detok: IncrementalDetokenizer
    error: str | None = None
    error_type: str = "server_error"  # or invalid_request_error: the request's own fault


class Engine:
    """The model-thread engine, built from its parts by `engine/factory.py` (`build_engine`)."""

    def __init__(
        self,
        config: EngineConfig,
        info: EngineInfo,
        *,
        model,
        tokenizer,
        scheduler: Scheduler,
        runner,
        guides: GuideDriver,
        speculation: SpeculationDriver | None = None,
        encoder_cache=None,
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        async_scheduling: bool = False,
    ):
        self.config = config
        self.info = info
        self.model = model
        self.tokenizer = tokenizer  # the detokenizers' (request-side tokenizing is the InputProcessor's)
        self.scheduler = scheduler
        self.runner = runner
        self.guides = guides  # structured outputs' driver: each steered request's guide, the masks
        self.speculation = speculation  # speculative decoding's driver, when configured
        self.encoder_cache = encoder_cache
        self.device, self.dtype = device, dtype
        self.async_scheduling = async_scheduling
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[TokenDelta] = []  # deltas produced outside step() (aborts)
        self._arrivals = 0
        self._num_host_readers = 0  # tracked requests whose sampling reads earlier tokens (reads_history)
        self._inflight = None  # the launched step whose tokens have not been applied (async scheduling)
        # tokens applied by a step that ran alone (async scheduling: a verify step, a diffusion step),
        # emitted once the next step is launched: (tracked, tokens, logprobs) in order
        self._unemitted: list[tuple[_Tracked, list[int], list[TokenLogprobs] | None]] = []
        # cumulative host time per phase of step() (execute includes the device work it waits for)
        self.step_seconds = {"schedule": 0.0, "execute": 0.0, "update": 0.0, "steps": 0}

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> str:
        """Queue one processed sequence (engine/input_processor.py made and validated it); raises
        ValueError if its id is in use. No input work happens here: this runs on the model thread."""
        rid = request.request_id
        if rid in self._tracked:
            raise ValueError(f"request id {rid!r} is already in use")
        self._arrivals += 1
        req = Request.admit(request, self._arrivals)
        params = req.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            keep_special_token_ids=params.keep_special_token_ids,
        )
        self._tracked[rid] = _Tracked(req, detok)
        self._num_host_readers += req.reads_history
        self.guides.admit(rid, request.guide)
        self.scheduler.add(req)
        log.debug("%s added: %d prompt tokens", rid, req.num_prompt_tokens)
        return rid

    def abort(self, request_id: str) -> bool:
        """Cancel a request; idempotent. Its blocks are free at once; a final delta comes from step()."""
        t = self._tracked.get(request_id)
        if t is None or t.req.is_finished:
            return False
        self.scheduler.finish(t.req, FinishReason.ABORT)
        self._pending.append(self._final_delta(t, [], "", None))
        self._release_finished()
        return True

    def _release_finished(self) -> None:
        """The one teardown path of a finished, aborted or failed request (the scheduler has freed its
        blocks): the runner (image embeddings, buffer row) and every driver forget it."""
        ids = self.scheduler.take_finished()
        if ids:
            self.runner.release(ids)
            self.guides.release(ids)
            if self.speculation is not None:
                self.speculation.release(ids)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block and image embedding (model thread only). Returns the
        number of prefix blocks dropped."""
        if self.encoder_cache is not None:
            self.encoder_cache.reset()
        return self.kv.reset_prefix_cache()

    def cache_stats(self) -> dict:
        out = {"prefix_cache": self.kv.stats()}
        if self.encoder_cache is not None:
            out["vision_cache"] = self.encoder_cache.stats().as_dict()
        return out

    def report(self) -> StepReport:
        """The state after a step, for the metrics: the engine's own figures and each feature's
        report (lifetime totals where a figure counts; None for a feature that is off or unused)."""
        return StepReport(
            self.num_running,
            self.num_waiting,
            self.kv.pool.usage(),
            self.encoder_cache.stats() if self.encoder_cache is not None else None,
            (self.kv.query_tokens, self.kv.hit_tokens),
            self.speculation.report() if self.speculation is not None else None,
            self.guides.report(),
            self.lora_report(),
        )

    def lora_report(self) -> dict | None:
        """Sequences per LoRA adapter, running and waiting, and the device's slots (None: LoRA off)."""
        s = self.scheduler
        return s.lora.report(s.running, s.waiting) if s.lora is not None else None

    def has_unfinished(self) -> bool:
        return (
            bool(self._pending)
            or bool(self._unemitted)
            or self.scheduler.num_unfinished > 0
            or self._inflight is not None
        )

    @property
    def kv(self) -> KVCacheManager:
        return self.scheduler.kv

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """Schedule and launch one step; return the deltas of the step whose tokens arrived.

        With async scheduling (on for CUDA) the tokens of step N arrive during step N+1's call: step N+1
        is scheduled and launched first (its decode rows read step N's tokens on the device), so the
        host's scheduling, input building and detokenization overlap the device's work. The price: a
        request that stops on a token (EOS, stop id or string) has one extra position computed.
        A batch whose sampling needs earlier tokens' values (penalties, grammar masks) launches its
        forward pass, collects step N's tokens while it runs, then samples. A step that cannot
        overlap (a verify step, a diffusion step) still has its tokens detokenized after the next
        step is launched: with async scheduling the host's part between two such steps is only
        what the next one needs (applying the tokens, proposing, scheduling)."""
        deltas, self._pending = self._pending, []
        t0 = time.perf_counter()
        prev = self._inflight
        spec = self.speculation
        defer = self.async_scheduling  # a step's deltas may wait for the next launch
        ks = spec.begin_step() if spec is not None else None  # before the step in flight is collected
        waited = prev is not None and not self._can_overlap()
        if waited:
            deltas += self._resolve(prev, defer)
            prev = None
        if spec is not None:
            spec.propose(ks)
        t_plan = time.perf_counter()
        batch = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        # rows whose sampling reads earlier tokens on the host (a guide's mask, penalties) wait for the
        # step in flight: its tokens are collected while this step's forward pass runs
        deferred = (
            prev is not None and not batch.empty and self._num_host_readers and self._reads_host_tokens(batch)
        )
        if not batch.empty:
            try:
                launched = self.runner.launch(batch, sample=False)
                if not deferred:  # the guides' masks are filled while the forward pass runs
                    self.runner.sample(launched, self.guides.masks(batch.items))
                if spec is not None:  # a drafter's work that needs only this step's prompt chunks
                    spec.launched(launched)
            except Exception as e:  # a failed forward pass aborts only this batch's requests
                log.exception("forward pass failed; aborting %d request(s)", len(batch.items))
                deltas += self._emit_deferred()
                if prev is not None:
                    deltas += self._resolve(prev)
                self._inflight = None
                return deltas + self._abort_batch(batch, e)
            self.scheduler.advance(batch)
        deltas += self._emit_deferred()  # the device has this step's work now
        t2 = time.perf_counter()
        if prev is not None:
            deltas += self._resolve(prev)
        if deferred:
            try:
                self.runner.sample(launched, self.guides.masks(batch.items))
            except Exception as e:
                log.exception("sampling failed; aborting %d request(s)", len(batch.items))
                self._inflight = None
                return deltas + self._abort_batch(batch, e)
        self._inflight = launched
        alone = launched is not None and not (self.async_scheduling and self._can_overlap())
        if alone:
            deltas += self._resolve(launched, defer)
        self._release_finished()
        if spec is not None:
            ran_alone = (waited or alone) if self.async_scheduling else None
            spec.step_done(batch, prev, t_plan, self._inflight, ran_alone)
        t = self.step_seconds
        t["schedule"] += t1 - t0
        t["execute"] += t2 - t1
        t["update"] += time.perf_counter() - t2
        t["steps"] += not batch.empty
        return deltas

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the tokens in flight arrive: not for a
        diffusion model, nor while speculating (SpeculationDriver.overlaps). Rows whose sampling reads
        earlier tokens (`_reads_host_tokens`) overlap too: their step's forward pass is launched first,
        their sampling once those tokens are in."""
        spec = self.speculation
        return (spec is None or spec.overlaps()) and self.info.diffusion is None

    def _reads_host_tokens(self, batch) -> bool:
        """Whether a row of the batch samples from its earlier tokens' values on the host: a guide's
        mask, or penalties on a verify run (one-row steps count on the device: sample/history.py);
        only looked for while some tracked request may (`reads_history`, `_num_host_readers`)."""
        for s in batch.items:
            t = self._tracked.get(s.request_id) if s.num_logits else None
            if t is not None and (t.req.guide is not None or (s.num_drafts and t.req.params.needs_penalties)):
                return True
        return False

    def _emit_deferred(self) -> list[TokenDelta]:
        """The deltas of tokens a step applied without emitting them (`_resolve(defer=True)`), but for
        requests that ended meanwhile with a final delta of their own (aborted, failed)."""
        ready, self._unemitted = self._unemitted, []
        tracked = self._tracked
        return [self._emit(t, toks, lps) for t, toks, lps in ready if tracked.get(t.req.request_id) is t]

    def _resolve(self, launched, defer: bool = False) -> list[TokenDelta]:
        """Wait for a launched step's tokens; apply them and emit the deltas (`defer`: detokenize and
        emit them at the next step's launch instead, `_emit_deferred`)."""
        if self._inflight is launched:
            self._inflight = None
        live = [
            self._tracked[s.request_id]
            for s in launched.batch.items
            if s.num_logits and s.request_id in self._tracked
        ]
        live = [t for t in live if not t.req.is_finished]
        try:
            out = self.runner.collect(launched)
        except Exception as e:  # the device failed this step
            log.exception("collecting a step failed; aborting %d request(s)", len(launched.batch.items))
            return self._abort_batch(launched.batch, e)
        if self.speculation is not None:
            self.speculation.observe(launched.batch, out)
        for rid, spent in out.encoder_time_s.items():
            t = self._tracked.get(rid)
            if t is not None:
                t.req.encoder_time_s += spent
        self.scheduler.resolve(launched.batch, out.tokens, out.confidence)
        ends = self.guides.advance(out.tokens)
        for rid in ends.done:  # the grammar is complete: nothing but EOS could follow
            t = self._tracked.get(rid)
            if t is not None:
                req = t.req
                decided = req.finish_reason if req.is_finished else None
                reason = stops.after_guide_end(decided, rid in ends.cut)
                if not req.is_finished:
                    self.scheduler.finish(req, reason)
                else:
                    req.finish_reason = reason
        for rid, why in ends.errors.items():  # its guide failed: this request ends, alone
            t = self._tracked.get(rid)
            if t is not None and not t.req.is_finished:
                t.error = why
                if rid in ends.bad_grammars:
                    t.error_type = "invalid_request_error"
                self.scheduler.finish(t.req, FinishReason.ERROR)
        deltas = []
        for t in live:
            toks = out.tokens.get(t.req.request_id)
            if toks and defer:
                self._unemitted.append((t, toks, out.logprobs.get(t.req.request_id)))
            elif toks:
                deltas.append(self._emit(t, toks, out.logprobs.get(t.req.request_id)))
        for rid, vector in out.pooled.items():  # an embedding request: its prompt is done, so is it
            t = self._tracked.get(rid)
            if t is not None and not t.req.is_finished:
                self.scheduler.finish(t.req, FinishReason.STOP)
                deltas.append(self._final_delta(t, [], "", None))
                deltas[-1].embedding = vector.tolist()
        return deltas

    def _abort_batch(self, batch, e: Exception) -> list[TokenDelta]:
        deltas = []
        for s in batch.items:
            t = self._tracked.get(s.request_id)
            if t is None or t.req.is_finished:
                continue
            t.error = f"forward pass failed: {type(e).__name__}: {e}"
            self.scheduler.finish(t.req, FinishReason.ERROR)
            deltas.append(self._final_delta(t, [], "", None))
        return deltas

    def _emit(self, t: _Tracked, toks: list[int], lps: list[TokenLogprobs] | None) -> TokenDelta:
        """The delta of a request's new tokens (several after a verify step): text through the
        detokenizer one token at a time, so a stop string inside the run ends it there."""
        req = t.req
        stop_reason: str | int | None = None
        text = ""
        try:
            for j, tok in enumerate(toks):
                text += t.detok.add([tok])
                if t.detok.stop_matched is not None:
                    req.drop_output(len(toks) - j - 1)  # a verify run's tokens after the stop string
                    del toks[j + 1 :]
                    self.scheduler.finish(req, FinishReason.STOP)
                    req.finish_reason = FinishReason.STOP  # a stop string wins over a length stop (stops.py)
                    break
            if req.is_finished:
                if t.detok.stop_matched is not None:
                    stop_reason = t.detok.stop_matched
                else:
                    text += t.detok.flush()
                    if toks[-1] in req.params.stop_token_ids:
                        stop_reason = toks[-1]
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # this request's failure only (a Rust tokenizer's panic included)
            log.exception("%s: detokenization failed", req.request_id)
            t.error = f"detokenization failed: {type(e).__name__}: {e}"
            self.scheduler.finish(req, FinishReason.ERROR)
            text = ""
        lps = lps[: len(toks)] if lps else None
        if not req.is_finished:
            return TokenDelta(req.request_id, toks, text, lps)
        if req.finish_reason is FinishReason.ERROR and t.error is None:
            t.error = "request failed"
        return self._final_delta(t, toks, text, lps, stop_reason)

    def _final_delta(self, t: _Tracked, toks, text, lps, stop_reason=None) -> TokenDelta:
        req = t.req
        if self._tracked.pop(req.request_id, None) is not None:
            self._num_host_readers -= req.reads_history
        if req.status is not RequestStatus.FINISHED:  # defensive: never leave a request half-done
            self.scheduler.finish(req, FinishReason.ERROR)
        return TokenDelta(
            req.request_id,
            toks,
            text,
            lps,
            finish_reason=req.finish_reason,
            stop_reason=stop_reason,
            error=t.error,
            error_type=t.error_type,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_images=len(req.mm_items),
            encoder_time_s=req.encoder_time_s,
            num_cached_tokens=req.num_cached_tokens,
        )
