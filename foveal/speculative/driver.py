"""Speculative decoding's driver: everything the engine's step does for speculation, behind one object
that `engine/factory.py` builds when `--speculative-config` is given (the engine holds None otherwise).

The engine calls it at fixed points of `Engine.step` and nowhere else:

    ks = driver.begin_step()          before the step in flight is collected: rest, probe or ask
    [the step in flight is collected when the next one may not overlap it: driver.overlaps]
    driver.propose(ks)                drafts for the rows that may speculate (req.draft_ids, or staged
                                      in the runner's token buffer on the device)
    [schedule, launch]
    driver.launched(launched)         a hidden-state drafter feeds the step's prompt chunks behind it,
                                      and a head drafts each verify run's next proposal behind it
    [collect]
    driver.observe(batch, out)        after a step's tokens arrived: hidden states to the drafter,
                                      accepted counts to the proposer, the policy and the stats
    driver.step_done(batch, prev, t_plan, inflight, waited_or_alone)
                                      the step's cost for the load-aware policy, why it ran alone
    driver.release(request_ids)       requests that ended (the engine's one teardown path)
    driver.report()                   the metrics' totals

It owns the proposer (foveal.speculative.proposer), the load-aware policy (adaptive.py), the counts
(SpecStats) and the rest/probe countdown; the scheduler sees only each request's `draft_ids`, the
runner only the staged drafts.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from foveal.sched.batch import DEVICE_DRAFT
from foveal.speculative.proposer import ProposeRow, split_drafts

if TYPE_CHECKING:
    from foveal.request import Request
    from foveal.sched.scheduler import Scheduler
    from foveal.speculative.adaptive import AdaptivePolicy
    from foveal.speculative.proposer import Proposer

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


class SpeculationDriver:
    """Drafts, their verification's bookkeeping and the load-aware policy, for `Engine.step`."""

    def __init__(
        self,
        proposer: Proposer,
        *,
        method: str,
        adaptive: bool,
        scheduler: Scheduler,
        runner,
        max_model_len: int,
    ):
        self.proposer = proposer
        self.method = method
        self.scheduler = scheduler
        self.runner = runner  # stage_drafts: drafts computed on the device stay there
        self.max_model_len = max_model_len
        self.policy: AdaptivePolicy | None = None  # load-aware k per row, when speculating adaptively
        if adaptive:
            from foveal.speculative.adaptive import AdaptivePolicy

            self.policy = AdaptivePolicy(proposer.num_speculative_tokens)
        self.stats = SpecStats()
        # steps run without overlap, by why (a verify step; a plain one), and the policy's answers (to
        # draft, to rest, to probe): per-run counts for benchmarks (async scheduling only)
        self.sync: Counter = Counter()
        self.asks: Counter = Counter()
        self._rest = 0  # steps left without proposing (the policy gave every row k = 0)
        self.resting = False  # this step is one of them: it may overlap like plain decoding
        self._rest_streak = 0  # rests in a row (each one twice as long as the one before)
        self._rest_rows = 0  # running requests when the rest began

    # -- before the step ----------------------------------------------------------------------------
    def begin_step(self) -> dict[str, int] | None:
        """Rest, probe or ask the policy, before the step in flight is collected (its tokens already
        count in each row's length, so the rows' rooms are known). Returns the policy's drafts per
        request id, or None (no policy, or resting). Where no row gets a draft the step is a plain one
        and overlaps like a rest's (`resting`); only drafting waits for the step in flight."""
        if self._rest and len(self.scheduler.running) * 2 < self._rest_rows:
            self._rest = self._rest_streak = 0  # the load halved since: ask again now
        self.resting = self._rest > 0
        self._rest -= self.resting
        if self.policy is None or self.resting:
            return None
        if self._prompts_fill_budget():
            self.resting = True  # drafts would only take prompt tokens' place: a plain step, unasked
            return None
        ks = self._ask()
        self.resting = not any(ks.values())
        return ks

    def overlaps(self) -> bool:
        """Whether the next step may be scheduled before the tokens in flight arrive: only while resting
        (proposals start from every token, and a verify row's count of new tokens is known only on the
        host)."""
        return self.resting

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

    def _rows(self, pending: bool = False) -> tuple[list[Request], list[int]]:
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
                self.max_model_len - req.num_tokens - 1,
            )
            if room > 0:
                reqs.append(req)
                rooms.append(room)
        return reqs, rooms

    def _ask(self) -> dict[str, int]:
        """The load-aware policy's drafts per request id at this step's load (0: none; no rows: {}),
        asked with the step in flight (if any) not yet collected; rests and probes follow its answer."""
        policy = self.policy
        reqs, rooms = self._rows(pending=True)
        if not reqs:
            return {}
        other = len(self.scheduler.running) - len(reqs)
        ks = policy.choose([q.request_id for q in reqs], rooms, other)
        self._rest_rows = len(self.scheduler.running)
        if policy.probing:  # plain decoding's cost is not known at this load: a few plain steps
            self._rest = _PROBE_STEPS
            self.asks["probe"] += 1
        elif not any(ks):  # speculation does not pay at this load: plain steps, longer each time it is
            # confirmed (an answer of k = 0 costs no overlap; the rests spare asking each step)
            self._rest = min(_REST_STEPS << self._rest_streak, _MAX_REST_STEPS)
            self._rest_streak += 1
            self.asks["rest"] += 1
        else:
            self._rest_streak = 0
            self.asks["draft"] += 1
        return {q.request_id: k for q, k in zip(reqs, ks)}

    def propose(self, ks: dict[str, int] | None) -> None:
        """Drafts for every running decode that may speculate (`ks`: the policy's drafts per request,
        asked before the step in flight was collected; a row that finished since drops out); the
        scheduler gives each 1 + k tokens. Nothing while resting."""
        if self.resting:
            return
        reqs, rooms = self._rows()
        if ks is not None:  # how many drafts each row takes at this load (0: none)
            rooms = [min(room, ks.get(q.request_id, 0)) for q, room in zip(reqs, rooms)]
            reqs, rooms = [q for q, k in zip(reqs, rooms) if k], [k for k in rooms if k]
        if not reqs:
            return
        rows = [ProposeRow(q.request_id, q.all_token_ids, k) for q, k in zip(reqs, rooms)]
        t0 = time.perf_counter()
        if getattr(self.proposer, "propose_device", None) is not None:
            drafts = self._stage(reqs, rows)
        else:
            drafts = self.proposer.propose(rows)
        for req, d in zip(reqs, drafts):
            req.draft_ids = d
        if self.policy is not None:
            self.policy.observe_drafting(len(rows), max(rooms), time.perf_counter() - t0)

    def _stage(self, reqs: list[Request], rows: list[ProposeRow]) -> list[list[int]]:
        """Drafts computed on the device, staged in the runner's token buffer unread: each row's draft
        ids are DEVICE_DRAFT placeholders, so the verify step is launched while the device still
        drafts. Rows whose sampling reads the drafts' values (`reads_history`) get them read back."""
        flat, counts = self.proposer.propose_device(rows)
        staged = self.runner.stage_drafts([q.request_id for q in reqs], counts, flat)
        read = [not ok or q.reads_history for q, ok in zip(reqs, staged)]
        values = flat.tolist() if any(r and c for r, c in zip(read, counts)) else None
        out = split_drafts(values, counts) if values is not None else [[]] * len(counts)
        return [d if r else [DEVICE_DRAFT] * c for d, r, c in zip(out, read, counts)]

    def launched(self, launched) -> None:
        """A step was launched (and sampled): a hidden-state drafter takes its prompt chunks' states
        now (their tokens are known) and feeds them behind the step on the device, so that host work
        overlaps the step and the proposal after the prompt's last chunk feeds only its last position.
        A drafter that follows verify steps (`follow`) computes the next proposal of each verify run
        behind it, from the step's tokens and accepted counts on the device: the host launches it while
        the verify step runs, and the next propose() only stages its drafts."""
        follow = getattr(self.proposer, "follow", None)
        prefeed = getattr(self.proposer, "prefeed", None)
        if (follow is None and prefeed is None) or launched is None or launched.tapped is None:
            return
        get = self.scheduler.get
        if follow is not None and launched.tokens is not None:
            runs = [
                r
                for r in self.runner.verify_runs(launched)
                if (q := get(r.request_id)) is not None and q.params.speculative
            ]
            if runs:
                follow(runs, launched.tokens, launched.accepted, launched.tapped)
        if prefeed is None:
            return
        rows, states = [], {}
        for rid, (start, h) in self.runner.prompt_hidden(launched).items():
            q = get(rid)
            if q is not None and q.params.speculative:
                states[rid] = (start, h)
                # the tokens up to the one after the last state: the pairs it may feed
                rows.append(ProposeRow(rid, q.all_token_ids[: start + h.shape[0] + 1], 0))
        if rows:
            self.proposer.observe_hidden(states)
            prefeed(rows)

    # -- after the step -----------------------------------------------------------------------------
    def observe(self, batch, out) -> None:
        """A step's tokens arrived (before the scheduler applies them): the target's hidden states go to
        a hidden-state drafter, each verify row's accepted count to the proposer, the policy and the
        stats."""
        if out.hidden:  # a hidden-state drafter's inputs, for the requests that may speculate
            get = self.scheduler.get
            self.proposer.observe_hidden(
                {
                    rid: h
                    for rid, h in out.hidden.items()
                    if (q := get(rid)) is not None and q.params.speculative
                }
            )
        for s in batch.items:
            if s.num_drafts and s.request_id in out.tokens:
                a = len(out.tokens[s.request_id]) - 1
                self.stats.record(s.num_drafts, a)
                self.proposer.accepted(s.request_id, s.num_drafts, a)
                if self.policy is not None:
                    self.policy.observe_acceptance(s.request_id, s.num_drafts, a)

    def step_done(self, batch, prev, t_plan: float, inflight, ran_alone: bool | None) -> None:
        """After `Engine.step` launched `batch` (and collected `prev`, the step before it, if any):
        `ran_alone` (async scheduling only; None without it) counts a step that did not overlap, by
        why; the load-aware policy learns the step's cost."""
        if ran_alone:
            self.sync["verify" if any(x.num_drafts for x in batch.items) else "plain"] += 1
        if self.policy is not None:
            self._observe_cost(batch, prev, t_plan, inflight)

    def _observe_cost(self, batch, prev, t_plan: float, inflight) -> None:
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
            self.policy.observe_step(sum(x.num_tokens for x in items), seconds, verify=True)
        elif not self.resting:
            return  # a plain step that waited for the one before it (not as plain decoding runs)
        elif inflight is None:  # collected in this step: no overlap
            self.policy.observe_step(sum(x.num_tokens for x in items), seconds)
        elif prev is not None and all(x.is_decode and not x.num_drafts for x in prev.batch.items):
            self.policy.observe_step(sum(x.num_tokens for x in prev.batch.items), seconds)

    def release(self, request_ids: list[str]) -> None:
        """The requests ended: the proposer and the policy forget them."""
        for rid in request_ids:
            self.proposer.finish(rid)
            if self.policy is not None:
                self.policy.finish(rid)

    def report(self) -> dict:
        """Lifetime totals for the metrics: SpecStats, the method, the policy's chosen drafts."""
        out = self.stats.as_dict()
        out["method"] = self.method
        if self.policy is not None:  # how many drafts the load-aware policy gave rows
            out.update(self.policy.stats())
        return out
