"""Load-aware speculation: each step, how many drafts each row takes (0 included).

Speculating pays when the tokens a verify step is expected to yield per second beat plain decoding's.
At batch 1 a step of 1 + k tokens costs about what a 1-token step costs (the weights are read once),
so drafts are nearly free; at high load the device is compute-bound, every scheduled token costs, and
drafts the target rejects are lost work (the H200 oracle: batch 64, 40% acceptance, 0.80x; CPU batch 16
with a large draft: 0.50x). The policy picks, per step, the drafts that maximize expected tokens per
second under the cost curves it measures as it runs:

    E(k)    expected tokens = rows + sum over rows of a_r (1 + c_2 + c_2 c_3 + ... + c_2 .. c_k_r)
            (every row of the step counted, speculating or not; a_r: the row's chance that its first
            draft is accepted; c_j: the chance, over recent requests, that draft j is accepted when
            draft j - 1 was: measured per position, as one run's drafts are correlated)
    P(r)    seconds of a plain decode step of r rows (as plain steps run: overlapped)
    T(n)    seconds of a verify step that schedules n tokens
    D(r, k) seconds of proposing: a per-draft-step cost by drafting rows, times the longest k

    maximize E / (T(rows + sum k) + D) over the plans: depth d (0 .. max_k) for every row, or only
    for the rows whose acceptance is at least the mean (where those are 0.2 above the rest); a row's
    room (max_tokens, context) caps it; all k = 0 costs P(rows); a plan with drafts must promise 5%
    more than plain decoding

Few plans means few step sizes, each measured after a step or two: choosing every row's k freely
visits so many sizes that a short run is mostly exploration (the H200 oracle at batch 64 showed it:
sizes between the CUDA-graph and eager paths cost more than either). All k = 0 is a candidate, so
the choice is plain decoding whenever the curves say speculation loses.
A request's first-draft acceptance is counted and shrunk towards recent requests' (a new request
starts from theirs). Acceptance is learnt from verify steps only: where the figures say drafting loses
none run, so a workload whose acceptance rose is noticed only where drafting at the old figure pays.
The engine asks about decode steps only: a step whose token budget prompt chunks fill runs plain (a
draft would take a prompt token's place, at the same cost, and is worth a token only if accepted).

The curves are measured step times, kept per size bucket (quarter octaves) as running means and
interpolated between. Plain steps and verify steps are kept apart: a verify step of n tokens over n /
(1 + k) rows does not cost what a plain step of n rows does (on the H200 a 256-token verify step at batch 64
took 13-15 ms, a 256-row plain step 11 ms), and a plain figure taken from verify steps (or from a larger
size, flat) made plain decoding look dear at batch 256 (0.90x: 1280-token verify steps chosen at 69 ms
each, where 256 plain rows cost 11). P is read from plain steps only: where plain decoding's own bucket
has no live measurement at the current load, the step is a plain one (what a server without speculation
would run anyway) and `probing` says so; the engine then runs a few plain steps the way it runs them
when speculation does not pay (overlapped), which is the cost to compare with. T(n) is interpolated from
P at this load (and below it) to the verify sizes measured above it, never below P(rows); past the
largest of those it grows at the last stretch's cost per token (at least what a row more costs at this
load), between flat and proportional to the size. A single point is extended flat (batch 1's first
verify size is assumed as cheap as a plain step: it gets tried, then known); a size far past what was
measured is not assumed to cost what the largest did (at batch 256 after batch 64: 1280 tokens from the
256-row plain step and the 320-token verify step, 72 ms, where flat from 320 tokens said 18). A size's
first step is not used (it often pays first-use work: a kernel compiled, a graph recorded), so each size
is tried twice and the faster of its first two steps kept; the running means lean to the lower envelope
(a slow step is mostly interference: it moves the estimate up a little, counting at most twice the
estimate); a size measured few times is taken as up to 20% cheaper than measured, so a bad first
impression is checked again; and a bucket not refreshed for `stale_after` decode steps (of either kind)
is forgotten.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import numpy as np

log = logging.getLogger(__name__)

_LOG_EVERY = 5000  # row decisions between two log lines
_MARGIN = 0.05  # a plan with drafts must promise this much more than plain decoding (estimates err)
_SPREAD = 0.2  # mean acceptance gap between the keen rows and the rest that earns them a plan apart
_PRIOR_WEIGHT = 4.0  # pseudo-trials of everyone's acceptance in a request's estimate
# recent requests' counts are halved whenever they pass this many verify rows (2 requests of 256 tokens
# at batch 1, 8 steps at batch 64): a workload whose acceptance fell is followed within a run (at 4000
# the simulated H200 with dear host work, batch 64 at 70% after 100%, drafted on 100%'s figures: 0.93x)
_ALL_HORIZON = 500.0
_EXPLORE = 0.2  # optimism for a size measured few times (see CostCurve.live)
_DOWN, _UP = 0.5, 0.1  # running-mean weight of a new measurement below / above the estimate


def _bucket(size: float) -> int:
    return round(4 * math.log2(max(size, 1)))  # a quarter octave: exact up to 8, then ~19% wide


class CostCurve:
    """Seconds as a function of a size, measured: per quarter-octave bucket a running mean of (size,
    seconds); interpolated linearly between buckets, flat below the measured range and past it as
    `_interp` extends it."""

    def __init__(self, stale_after: int = 2000, explore: float = _EXPLORE):
        self.explore = explore
        # bucket -> (size, seconds, when, steps counted: 0 for a first step, which is not used)
        self.points: dict[int, tuple[float, float, int, int]] = {}
        self.clock = 0
        self.stale_after = stale_after

    def observe(self, size: float, seconds: float) -> None:
        if size <= 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self.clock += 1
        b = _bucket(size)
        old = self.points.get(b)
        if old is None:  # a size's first step often pays first-use work (a kernel compiled, a graph
            self.points[b] = (float(size), seconds, self.clock, 0)  # recorded): not used
        elif not old[3]:  # the second step: the faster of the two
            self.points[b] = (float(size), min(seconds, old[1]), self.clock, 1)
        elif self.clock - old[2] > self.stale_after:
            self.points[b] = (float(size), seconds, self.clock, 1)
        else:  # towards the lower envelope: a slow step is mostly interference (or first-use work at a
            # size of the bucket not seen before), so it moves the estimate up a little, at most 2x
            d = _DOWN if seconds < old[1] else _UP
            seconds = min(seconds, 2 * old[1])
            n = old[3] + 1
            self.points[b] = ((1 - d) * old[0] + d * size, (1 - d) * old[1] + d * seconds, self.clock, n)

    def live(self) -> list[tuple[float, float]]:
        """The measurements in use: (size, seconds), by size; a size measured few times is shown
        cheaper than measured (by `explore` / sqrt(steps)), so one that measured badly once is tried
        again until its figure is sure."""
        fresh = self.clock - self.stale_after
        return sorted(
            (p[0], p[1] * (1 - self.explore / math.sqrt(p[3])))
            for p in self.points.values()
            if p[3] and p[2] >= fresh
        )

    def measured(self, size: int) -> bool:
        """Whether the bucket of `size` has a live measurement."""
        p = self.points.get(_bucket(size))
        return p is not None and p[3] > 0 and self.clock - p[2] <= self.stale_after

    def estimate(self, sizes: np.ndarray) -> np.ndarray:
        """Seconds for each size (0 for every size while nothing was measured)."""
        live = self.live()
        if not live:
            return np.zeros(len(sizes))
        return _interp(sizes, [p[0] for p in live], [p[1] for p in live])


def _interp(sizes, xs, ys, min_slope: float = 0.0) -> np.ndarray:
    """Linear between the points (xs increasing), flat below the first; past the last it grows at the
    last segment's slope (at least `min_slope`), taken between 0 and the last point's seconds per unit
    (flat and proportional): a size past everything measured costs at least what the last stretch says
    more. One point: flat (or `min_slope`)."""
    sizes = np.asarray(sizes, dtype=float)
    out = np.interp(sizes, xs, ys)
    last = (ys[-1] - ys[-2]) / max(xs[-1] - xs[-2], 1e-9) if len(xs) > 1 else 0.0
    slope = min(max(last, min_slope, 0.0), ys[-1] / max(xs[-1], 1e-9))
    return np.where(sizes > xs[-1], ys[-1] + slope * (sizes - xs[-1]), out)


class AdaptivePolicy:
    """Chooses each speculating row's number of drafts (see the module docstring)."""

    def __init__(self, max_k: int, stale_after: int = 2000, explore: float = _EXPLORE):
        self.max_k = max_k
        self.plain_cost = CostCurve(stale_after, explore)  # plain decode-step seconds by rows: P
        self.verify_cost = CostCurve(stale_after, explore)  # verify-step seconds by scheduled tokens: T
        self.draft_cost = CostCurve(stale_after, explore)  # seconds per draft step by drafting rows
        self._acc: dict[str, list[float]] = {}  # request id -> [first drafts accepted, first drafts]
        self._all = [0.0, 0.0]  # the same over recent requests
        # [j]: drafts at position j (0-based) judged, i.e. with every earlier draft accepted; accepted
        self._deep = [[0.0, 0.0] for _ in range(max_k)]
        self.chosen = Counter()  # k -> row-steps that took it (exported)
        self._window = [0, 0]  # row decisions and drafts since the last log line
        self.probing = False  # the last choice was k = 0 only to measure plain decoding's cost

    def acceptance(self, request_id: str) -> float:
        """The request's chance that its first draft is accepted (shrunk towards recent requests')."""
        a_all = (self._all[0] + 1.0) / (self._all[1] + 2.0)
        a, n = self._acc.get(request_id, (0.0, 0.0))
        return (a + _PRIOR_WEIGHT * a_all) / (n + _PRIOR_WEIGHT)

    def continuation(self) -> np.ndarray:
        """[j]: the chance that draft j (0-based) is accepted when draft j - 1 was (recent requests; 1 at
        j = 0). Drafts of one run are correlated (an n-gram match holds or breaks), so this is measured
        per position rather than taken as the first draft's rate again."""
        a1 = (self._all[0] + 1.0) / (self._all[1] + 2.0)
        return np.array([1.0] + [(a + 2 * a1) / (n + 2) for a, n in self._deep[1:]])

    def gains(self, request_ids: list[str]) -> np.ndarray:
        """[row, d]: the tokens a row's first d drafts add, in expectation (d = 0 .. max_k)."""
        alpha = np.fromiter((self.acceptance(r) for r in request_ids), float, len(request_ids))
        depth = np.concatenate([[0.0], np.cumsum(np.cumprod(self.continuation()))])
        return alpha[:, None] * depth[None, :]

    def choose(self, request_ids: list[str], rooms: list[int], other: int = 0) -> list[int]:
        """Drafts for each row (<= its room and max_k). `other`: the step's other rows (running, not
        speculating), each counted as one token scheduled and one produced."""
        rows = len(request_ids)
        K = self.max_k
        caps = np.minimum(np.asarray(rooms, dtype=np.int64), K)
        gain = self.gains(request_ids)
        alpha = gain[:, 1]  # the first draft's acceptance
        # candidates: depth d for every row, or only for the rows at or above the mean acceptance
        # (a few step sizes, each soon measured); a row's room caps its depth
        keen = alpha >= alpha.mean() if rows else alpha > 0
        masks = [1]
        if keen.any() and (~keen).any() and alpha[keen].mean() - alpha[~keen].mean() >= _SPREAD:
            masks.append(keen)  # only where acceptance really differs (else: more sizes, no gain)
        plans = [np.minimum(d, caps) * (mask if d else 1) for d in range(K + 1) for mask in masks]
        plans = plans[len(masks) - 1 :]  # one plain plan
        ks_all = np.stack(plans)  # [candidates, rows]
        expected = other + rows + gain[np.arange(rows)[None, :], ks_all].sum(1)
        n = other + rows + ks_all.sum(1)
        kmax = ks_all.max(1) if rows else np.zeros(len(plans), int)
        drafting = (ks_all > 0).sum(1)
        per_step = self.draft_cost.estimate(np.maximum(drafting, 1))
        seconds = self.step_seconds(n, other + rows) + np.where(kmax > 0, per_step * kmax, 0.0)
        self.probing = not self.plain_cost.measured(other + rows)
        if self.probing:  # plain decoding's cost at this load first: one plain step
            best = 0
        else:
            rate = expected / np.maximum(seconds, 1e-9)
            best = int(np.argmax(rate))  # ties: the fewest drafts
            if rate[best] < rate[0] * (1 + _MARGIN):  # not clearly better than plain decoding
                best = 0
        ks = ks_all[best].tolist()
        best = int(ks_all[best].sum())
        self.chosen.update(ks)
        self._window[0] += rows
        self._window[1] += best
        if self._window[0] >= _LOG_EVERY:
            log.info(
                "speculation: mean k %.2f of %d over the last %d row-steps (first-draft acceptance %.2f)",
                self._window[1] / self._window[0], self.max_k, self._window[0],
                (self._all[0] + 1.0) / (self._all[1] + 2.0),  # the first draft's
            )  # fmt: skip
            self._window = [0, 0]
        return ks

    def step_seconds(self, sizes, load: int) -> np.ndarray:
        """Seconds of a decode step of each size (scheduled tokens) at `load` rows: P(load) for a plain
        step (size == load), T(size) for a verify step (see the module docstring)."""
        plain = float(self.plain_cost.estimate([load])[0])
        below = [p for p in self.plain_cost.live() if p[0] < load]
        # what a row more costs at this load: past every verify size measured, a token costs no less
        # (verify sizes just above the load, over fewer rows, can cost less than this load's plain step)
        per_row = (plain - below[-1][1]) / (load - below[-1][0]) if below else 0.0
        pts = below + [(float(load), plain)] + [p for p in self.verify_cost.live() if p[0] > load]
        verify = _interp(sizes, [p[0] for p in pts], [p[1] for p in pts], per_row)
        return np.where(np.asarray(sizes) > load, np.maximum(verify, plain), plain)

    def observe_step(self, tokens: int, seconds: float, verify: bool = False) -> None:
        """A decode step (no prompt chunk) took `seconds`: a verify step that scheduled `tokens` tokens,
        or a plain one of `tokens` rows."""
        mine, other = (self.verify_cost, self.plain_cost) if verify else (self.plain_cost, self.verify_cost)
        mine.observe(tokens, seconds)
        other.clock = mine.clock  # one clock: both curves age by decode steps

    def observe_drafting(self, rows: int, steps: int, seconds: float) -> None:
        """Proposing for `rows` rows, at most `steps` drafts deep, took `seconds`."""
        if rows and steps:
            self.draft_cost.observe(rows, seconds / steps)

    def observe_acceptance(self, request_id: str, drafts: int, accepted: int) -> None:
        if drafts <= 0:
            return
        first = 1.0 if accepted else 0.0
        s = self._acc.setdefault(request_id, [0.0, 0.0])
        s[0] += first
        s[1] += 1
        self._all[0] += first
        self._all[1] += 1
        deep = self._deep
        for j in range(1, min(drafts, accepted + 1, len(deep))):  # judged: every earlier one accepted
            deep[j][1] += 1
            deep[j][0] += j < accepted
        if self._all[1] > _ALL_HORIZON:  # recent requests count, older ones fade
            self._all = [x / 2 for x in self._all]
            self._deep = [[a / 2, n / 2] for a, n in deep]

    def finish(self, request_id: str) -> None:
        self._acc.pop(request_id, None)

    def stats(self) -> dict:
        total = sum(self.chosen.values())
        return {
            "chosen_k": {str(k): v for k, v in sorted(self.chosen.items())},
            "mean_chosen_k": sum(k * v for k, v in self.chosen.items()) / total if total else 0.0,
        }
