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
from collections import Counter
from dataclasses import dataclass, field

import torch

from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import EngineConfig
from foveal.diffusion.state import new_diffusion_state
from foveal.engine.detokenizer import IncrementalDetokenizer
from foveal.engine.input_processor import EngineInfo
from foveal.request import EngineRequest, FinishReason, Request, RequestStatus, TokenDelta, TokenLogprobs
from foveal.sched.batch import DEVICE_DRAFT
from foveal.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

# after the load-aware policy gives every row k = 0, this many plain steps (async scheduling allowed)
# before it is asked again; doubled each time it says so again, up to the max (cut short when the
# number of running requests halves). The policy is asked with the step before in flight, and a step it
# gives no drafts is a plain one that overlaps too: an answer of k = 0 costs no overlap, only the
# asking (the rests spare that host work)
_REST_STEPS = 16
_MAX_REST_STEPS = 256
# plain steps that measure plain decoding's cost (with overlap the first is not timed: nothing is in
# flight before it; and a size's first measurement is not counted)
_PROBE_STEPS = 4


@dataclass(slots=True)
class SpecStats:
    """Cumulative speculative-decoding counts (vLLM's spec_decode metrics)."""

    num_drafts: int = 0  # verify rows that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: rows whose draft j+1 was accepted

    def record(self, k: int, a: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += a
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for j in range(a):
            self.accepted_per_pos[j] += 1

    def as_dict(self) -> dict:
        n = self.num_drafts
        return {
            "num_drafts": n,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens
            else 0.0,
            # tokens per verify row: the accepted drafts plus the one the target adds
            "mean_acceptance_length": 1 + self.num_accepted_tokens / n if n else 0.0,
        }


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
        proposer=None,
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
        self.proposer = proposer  # speculative decoding (foveal.spec), when configured
        self.encoder_cache = encoder_cache
        self.device, self.dtype = device, dtype
        self.async_scheduling = async_scheduling
        self._tracked: dict[str, _Tracked] = {}
        self._pending: list[TokenDelta] = []  # deltas produced outside step() (aborts)
        self._arrivals = 0
        self._num_host_readers = 0  # tracked requests whose sampling reads earlier tokens (_reads_host)
        self._inflight = None  # the launched step whose tokens have not been applied (async scheduling)
        self.spec_stats = SpecStats()
        self.spec_policy = None  # load-aware k per row (foveal.spec.adaptive), when speculating adaptively
        self._spec_rest = 0  # steps left without proposing (the policy gave every row k = 0)
        self._resting = False  # this step is one of them: it may overlap like plain decoding
        self._rest_streak = 0  # rests in a row (each one twice as long as the one before)
        self._rest_rows = 0  # running requests when the rest began
        # steps run without overlap, by why (a verify step; a plain one), and the policy's answers (to
        # draft, to rest, to probe): per-run counts for benchmarks (async scheduling only)
        self.spec_sync: Counter = Counter()
        self.spec_asks: Counter = Counter()
        spec = getattr(config, "speculative", None)
        if proposer is not None and spec is not None and spec.adaptive:
            from foveal.spec.adaptive import AdaptivePolicy

            self.spec_policy = AdaptivePolicy(proposer.num_speculative_tokens)
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
        if self.info.diffusion is not None:
            req.diffusion = new_diffusion_state(self.info.diffusion, req)
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            keep_special_token_ids=params.keep_special_token_ids,
        )
        self._tracked[rid] = _Tracked(req, detok)
        self._num_host_readers += self._reads_host(req)
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
        """Let the runner forget the requests that finished (their image embeddings, buffer rows)."""
        ids = self.scheduler.take_finished()
        if ids:
            self.runner.release(ids)

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

    def lora_report(self) -> dict:
        """Sequences per LoRA adapter (its name), running and waiting, and the device's slots."""
        s = self.scheduler
        running = Counter(r.lora.name for r in s.running if r.lora is not None)
        waiting = Counter(r.lora.name for r in s.waiting if r.lora is not None)
        return {"running": dict(running), "waiting": dict(waiting), "max_loras": self.runner.lora.num_slots}

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self.scheduler.num_unfinished > 0 or self._inflight is not None

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
        forward pass, collects step N's tokens while it runs, then samples."""
        deltas, self._pending = self._pending, []
        t0 = time.perf_counter()
        prev = self._inflight
        if self._spec_rest and len(self.scheduler.running) * 2 < self._rest_rows:
            self._spec_rest = self._rest_streak = 0  # the load halved since: ask again now
        self._resting = self._spec_rest > 0  # the policy gave no row drafts: plain steps, overlapped
        self._spec_rest -= self._resting
        if not self._resting and self.spec_policy is not None and self._prompts_fill_budget():
            self._resting = True  # drafts would only take prompt tokens' place: a plain step, unasked
        ks = None
        if not self._resting and self.spec_policy is not None:
            # asked before the step in flight is collected (its tokens already count in each row's
            # length, so the rows' rooms are known): where no row gets a draft this is a plain step
            # and overlaps like a rest's; only drafting waits for those tokens
            ks = self._ask()
            self._resting = not any(ks.values())
        waited = prev is not None and not self._can_overlap()
        if waited:
            deltas += self._resolve(prev)
            prev = None
        if self.proposer is not None and not self._resting:
            self._propose(ks)
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
                launched = self.runner.launch(batch, sample=not deferred)
            except Exception as e:  # a failed forward pass aborts only this batch's requests
                log.exception("forward pass failed; aborting %d request(s)", len(batch.items))
                if prev is not None:
                    deltas += self._resolve(prev)
                self._inflight = None
                return deltas + self._abort_batch(batch, e)
            self.scheduler.advance(batch)
        t2 = time.perf_counter()
        if prev is not None:
            deltas += self._resolve(prev)
        if deferred:
            try:
                self.runner.sample(launched)
            except Exception as e:
                log.exception("sampling failed; aborting %d request(s)", len(batch.items))
                self._inflight = None
                return deltas + self._abort_batch(batch, e)
        self._inflight = launched
        alone = launched is not None and not (self.async_scheduling and self._can_overlap())
        if alone:
            deltas += self._resolve(launched)
        if self.async_scheduling and self.proposer is not None and (waited or alone):
            self.spec_sync["verify" if any(x.num_drafts for x in batch.items) else "plain"] += 1
        self._release_finished()
        if self.spec_policy is not None:
            self._observe_cost(batch, prev, t_plan)
        t = self.step_seconds
        t["schedule"] += t1 - t0
        t["execute"] += t2 - t1
        t["update"] += time.perf_counter() - t2
        t["steps"] += not batch.empty
        return deltas

    def _prompts_fill_budget(self) -> bool:
        """Whether prompt chunks will fill this step's token budget past its decode rows. Then a draft
        takes a prompt token's place, one for one: the step costs the same, and the prompt token was
        sure work where the draft is worth a token only if accepted (so the load-aware policy is not
        asked; its curves hold decode steps only)."""
        sched = self.scheduler
        left = sched.config.max_num_batched_tokens
        seats = sched.config.max_num_seqs - len(sched.running)
        for req in sched.running:
            left -= req.num_tokens - req.num_computed_tokens
            if left <= 0:
                return True
        for req in sched.waiting:
            if seats <= 0:
                break
            seats -= 1
            left -= req.num_tokens - req.num_computed_tokens
            if left <= 0:
                return True
        return False

    def _observe_cost(self, batch, prev, t_plan: float) -> None:
        """The cost of a decode step (no prompt chunk), by the tokens it scheduled, for the load-aware
        policy's curves. A verify step runs alone (proposing needs the tokens before it): from its
        scheduling to its tokens. A plain step as the policy's plain steps run (resting) overlaps the
        next one's scheduling: timed from its scheduling until the step in flight before it (`prev`)
        was collected, an interval that spans one device step, `prev`'s, so it counts at `prev`'s size
        and only where `prev` was a plain decode step too. A step with none in flight (the first plain one
        after a verify step, which waited for its own tokens) times host work alone: unused.
        Without overlap (CPU) a plain step is timed to its own tokens, like a verify step."""
        items = batch.items
        if not items or not all(x.is_decode for x in items):
            return
        seconds = time.perf_counter() - t_plan
        if any(x.num_drafts for x in items):
            self.spec_policy.observe_step(sum(x.num_tokens for x in items), seconds, verify=True)
        elif not self._resting:
            return  # a plain step that waited for the one before it (not as plain decoding runs)
        elif self._inflight is None:  # collected in this step: no overlap
            self.spec_policy.observe_step(sum(x.num_tokens for x in items), seconds)
        elif prev is not None and all(x.is_decode and not x.num_drafts for x in prev.batch.items):
            self.spec_policy.observe_step(sum(x.num_tokens for x in prev.batch.items), seconds)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before the tokens in flight arrive: not when
        speculating (proposals start from every token, and a verify row's count of new tokens is known
        only on the host), unless the load-aware policy is resting (it gave no row drafts: the next
        steps are plain ones). Rows whose sampling reads earlier tokens (`_reads_host_tokens`) overlap
        too: their step's forward pass is launched first, their sampling once those tokens are in."""
        return (self.proposer is None or self._resting) and self.info.diffusion is None

    @staticmethod
    def _reads_host(req: Request) -> bool:
        """Whether the request samples from its earlier tokens' values: a grammar or think-block guide
        (its mask follows them) or repetition/frequency/presence penalties (they count them)."""
        return req.guide is not None or req.params.needs_penalties

    def _reads_host_tokens(self, batch) -> bool:
        """Whether a row of the batch samples from its earlier tokens' values (`_reads_host`); only
        looked for while some tracked request does (`_num_host_readers`)."""
        for s in batch.items:
            t = self._tracked.get(s.request_id) if s.num_logits else None
            if t is not None and self._reads_host(t.req):
                return True
        return False

    def _spec_rows(self, pending: bool = False) -> tuple[list[Request], list[int]]:
        """The running decodes that may speculate, and each one's room for drafts (a verify row adds
        up to k + 1 tokens: it stays inside max_tokens and the context). `pending`: rows with tokens in
        flight count too (they count in the lengths already: the rooms are the same)."""
        reqs, rooms = [], []
        for req in self.scheduler.running:
            if not req.params.speculative or req.ends_after_pending or (req.num_pending and not pending):
                continue
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # a prefill chunk still to go
            room = min(
                req.params.max_tokens - req.num_output_tokens - 1,
                self.info.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                reqs.append(req)
                rooms.append(room)
        return reqs, rooms

    def _ask(self) -> dict[str, int]:
        """The load-aware policy's drafts per request id at this step's load (0: none; no rows: {}),
        asked with the step in flight (if any) not yet collected; rests and probes follow its answer."""
        policy = self.spec_policy
        reqs, rooms = self._spec_rows(pending=True)
        if not reqs:
            return {}
        other = len(self.scheduler.running) - len(reqs)
        ks = policy.choose([q.request_id for q in reqs], rooms, other)
        self._rest_rows = len(self.scheduler.running)
        if policy.probing:  # plain decoding's cost is not known at this load: a few plain steps
            self._spec_rest = _PROBE_STEPS
            self.spec_asks["probe"] += 1
        elif not any(ks):  # speculation does not pay at this load: plain steps, longer each time it is
            # confirmed (an answer of k = 0 costs no overlap; the rests spare asking each step)
            self._spec_rest = min(_REST_STEPS << self._rest_streak, _MAX_REST_STEPS)
            self._rest_streak += 1
            self.spec_asks["rest"] += 1
        else:
            self._rest_streak = 0
            self.spec_asks["draft"] += 1
        return {q.request_id: k for q, k in zip(reqs, ks)}

    def _propose(self, ks: dict[str, int] | None = None) -> None:
        """Drafts for every running decode that may speculate (`ks`: the policy's drafts per request,
        asked before the step in flight was collected; a row that finished since drops out); the
        scheduler gives each 1 + k tokens."""
        from foveal.spec.proposer import ProposeRow

        reqs, rooms = self._spec_rows()
        policy = self.spec_policy
        if ks is not None:  # how many drafts each row takes at this load (0: none)
            rooms = [min(room, ks.get(q.request_id, 0)) for q, room in zip(reqs, rooms)]
            reqs, rooms = [q for q, k in zip(reqs, rooms) if k], [k for k in rooms if k]
        if reqs:
            rows = [ProposeRow(q.request_id, q.all_token_ids, k) for q, k in zip(reqs, rooms)]
            t0 = time.perf_counter()
            if getattr(self.proposer, "propose_device", None) is not None:
                drafts = self._stage_drafts(reqs, rows)
            else:
                drafts = self.proposer.propose(rows)
            for req, d in zip(reqs, drafts):
                req.draft_ids = d
            if policy is not None:
                policy.observe_drafting(len(rows), max(rooms), time.perf_counter() - t0)

    def _stage_drafts(self, reqs: list[Request], rows) -> list[list[int]]:
        """Drafts computed on the device, staged in the runner's token buffer unread: each row's draft
        ids are DEVICE_DRAFT placeholders, so the verify step is launched while the device still
        drafts. Rows whose sampling reads the drafts' values (`_reads_host`) get them read back."""
        from foveal.spec.proposer import split_drafts

        flat, counts = self.proposer.propose_device(rows)
        staged = self.runner.stage_drafts([q.request_id for q in reqs], counts, flat)
        read = [not ok or self._reads_host(q) for q, ok in zip(reqs, staged)]
        values = flat.tolist() if any(r and c for r, c in zip(read, counts)) else None
        out = split_drafts(values, counts) if values is not None else [[]] * len(counts)
        return [d if r else [DEVICE_DRAFT] * c for d, r, c in zip(out, read, counts)]

    def _resolve(self, launched) -> list[TokenDelta]:
        """Wait for a launched step's tokens; apply them and emit the deltas."""
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
        if out.hidden:  # a hidden-state drafter's inputs, for the requests that may speculate
            self.proposer.observe_hidden(
                {
                    rid: h
                    for rid, h in out.hidden.items()
                    if (t := self._tracked.get(rid)) is not None and t.req.params.speculative
                }
            )
        for s in launched.batch.items:
            if s.num_drafts and s.request_id in out.tokens:
                a = len(out.tokens[s.request_id]) - 1
                self.spec_stats.record(s.num_drafts, a)
                self.proposer.accepted(s.request_id, s.num_drafts, a)
                if self.spec_policy is not None:
                    self.spec_policy.observe_acceptance(s.request_id, s.num_drafts, a)
        for rid, spent in out.encoder_time_s.items():
            t = self._tracked.get(rid)
            if t is not None:
                t.req.encoder_time_s += spent
        self.scheduler.resolve(launched.batch, out.tokens, out.confidence)
        for rid in out.done:  # the grammar is complete: nothing but EOS could follow
            t = self._tracked.get(rid)
            if t is not None:
                # closed early for max_tokens: a length stop, even where its last token was an EOS
                reason = FinishReason.LENGTH if rid in out.cut else FinishReason.STOP
                if not t.req.is_finished:
                    self.scheduler.finish(t.req, reason)
                elif reason is FinishReason.LENGTH and t.req.finish_reason is FinishReason.STOP:
                    t.req.finish_reason = reason
        for rid, why in out.errors.items():  # its guide failed: this request ends, alone
            t = self._tracked.get(rid)
            if t is not None and not t.req.is_finished:
                t.error = why
                if rid in out.bad_grammars:
                    t.error_type = "invalid_request_error"
                self.scheduler.finish(t.req, FinishReason.ERROR)
        deltas = []
        for t in live:
            toks = out.tokens.get(t.req.request_id)
            if toks:
                deltas.append(self._emit(t, toks, out.logprobs.get(t.req.request_id)))
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
                    req.finish_reason = FinishReason.STOP  # a stop string wins over a length stop
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
            self._num_host_readers -= self._reads_host(req)
        if self.proposer is not None:
            self.proposer.finish(req.request_id)
            if self.spec_policy is not None:
                self.spec_policy.finish(req.request_id)
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
