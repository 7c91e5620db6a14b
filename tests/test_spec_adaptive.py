"""The load-aware speculation policy (foveal.speculative.adaptive): its choices against a brute-force
optimum of the same objective on cost curves fed to it, its acceptance counting, its exploration, and an
engine with it on (greedy output equal to plain decoding whatever k it picks; the chosen k exported)."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from foveal.speculative.adaptive import AdaptivePolicy, CostCurve
from foveal.speculative.driver import SpeculationDriver


def fed(policy: AdaptivePolicy, step, draft=lambda rows: 0.0, sizes=range(1, 2049)) -> AdaptivePolicy:
    """Teach the policy a step-cost curve (seconds by scheduled tokens, plain and verify steps alike)
    and a draft-cost curve (built with stale_after large enough that none of it is forgotten)."""
    for _ in range(2):  # a size's first step is not used
        for n in sizes:
            policy.observe_step(n, step(n))
            policy.observe_step(n, step(n), verify=True)
        for r in range(1, 300):
            policy.observe_drafting(r, 1, draft(r))
    return policy


def with_acceptance(policy: AdaptivePolicy, rid: str, rate: float, steps: int = 400, seed: int = 0) -> None:
    """Verify outcomes of k = 4 drafts, each accepted with probability `rate` once the one before was
    (a geometric run), observed `steps` times."""
    rng = random.Random(f"{rid}{rate}{seed}")
    for _ in range(steps):
        a = 0
        while a < 4 and rng.random() < rate:
            a += 1
        policy.observe_acceptance(rid, 4, a)


def best_any(policy, rids, step, draft, max_k, other=0) -> tuple[float, float]:
    """Brute force over every per-row k under the policy's own expected gains: (best rate, rate of the
    policy's choice)."""
    gain = policy.gains(rids)

    def rate(ks):
        e = other + len(rids) + sum(gain[r, k] for r, k in enumerate(ks))
        t = step(other + len(rids) + sum(ks)) + (draft(sum(1 for k in ks if k)) * max(ks) if any(ks) else 0)
        return e / t

    best = max(rate(ks) for ks in itertools.product(range(max_k + 1), repeat=len(rids)))
    return best, rate(policy.choose(rids, [max_k] * len(rids), other))


def flat(n):  # a bandwidth-bound device: a step costs the same up to 64 tokens
    return 0.010 + 0.0001 * max(0, n - 64)


def linear(n):  # a compute-bound one: every token costs
    return 0.001 * n


def test_free_drafts_are_all_taken_and_costly_ones_none():
    p = fed(AdaptivePolicy(4, stale_after=10**6, explore=0), flat)
    with_acceptance(p, "a", 0.9)
    assert p.choose(["a"], [4]) == [4]
    p = fed(AdaptivePolicy(4, stale_after=10**6, explore=0), linear)
    with_acceptance(p, "a", 0.7)
    assert p.choose(["a", "a"], [4, 4], other=60) == [0, 0]  # below 100% acceptance a draft costs more
    # a draft model whose steps cost more than the target's: nothing
    p = fed(AdaptivePolicy(4, stale_after=10**6, explore=0), flat, draft=lambda r: 0.05)
    with_acceptance(p, "a", 0.9)
    assert p.choose(["a"], [4]) == [0]


@pytest.mark.parametrize("rates", [(0.9, 0.2), (0.6, 0.6, 0.3), (1.0, 0.5)])
@pytest.mark.parametrize("curve", ["affine", "flat", "knee"])
def test_choice_is_near_the_brute_force_optimum(rates, curve):
    step = {
        "affine": lambda n: 0.004 + 0.0005 * n,
        "flat": flat,
        "knee": lambda n: 0.01 if n <= 8 else 0.01 + 0.004 * (n - 8),
    }[curve]
    draft = lambda rows: 0.0005 * rows  # noqa: E731
    p = fed(AdaptivePolicy(3, stale_after=10**6, explore=0), step, draft)
    rids = [f"r{i}" for i in range(len(rates))]
    for rid, rate in zip(rids, rates):
        with_acceptance(p, rid, rate)
    best, got = best_any(p, rids, step, draft, 3, other=2)
    assert got == pytest.approx(best, rel=0.03), (got, best)  # interpolation error only


def test_a_row_with_higher_acceptance_gets_more_drafts():
    p = fed(AdaptivePolicy(4, stale_after=10**6, explore=0), lambda n: 0.004 + 0.0006 * n)
    with_acceptance(p, "good", 0.95)
    with_acceptance(p, "bad", 0.15)
    good, bad = p.choose(["good", "bad"], [4, 4], other=4)
    assert good > bad and bad == 0


def test_room_caps_the_drafts():
    p = fed(AdaptivePolicy(4, stale_after=10**6, explore=0), flat)
    with_acceptance(p, "a", 1.0)
    assert p.choose(["a", "a", "a"], [2, 0, 9]) == [2, 0, 4]


def test_acceptance_counts_first_drafts_and_deeper_ones_per_position():
    p = AdaptivePolicy(4)
    assert p.acceptance("new") == pytest.approx(0.5)  # nothing known: 1/2
    p.observe_acceptance("a", 4, 2)  # drafts 0, 1 accepted, 2 rejected, 3 never judged
    p.observe_acceptance("a", 4, 4)
    p.observe_acceptance("a", 3, 0)
    assert p._acc["a"] == [2, 3] and p._all == [2, 3]
    assert p._deep == [[0, 0], [2, 2], [1, 2], [1, 1]]  # [accepted, judged] per position 1 .. 3
    everyone = (2 + 1) / (3 + 2)
    assert p.acceptance("a") == pytest.approx((2 + 4 * everyone) / (3 + 4))
    assert p.acceptance("b") == pytest.approx(everyone)  # a new request starts from everyone's
    c = p.continuation()
    assert (
        c[0] == 1
        and c[1] == pytest.approx((2 + 2 * everyone) / 4)
        and c[3] == pytest.approx((1 + 2 * everyone) / 3)
    )
    g = p.gains(["a"])[0]
    assert g[0] == 0 and g[2] == pytest.approx(p.acceptance("a") * (1 + c[1]))
    p.finish("a")
    assert "a" not in p._acc


def test_correlated_runs_are_worth_more_than_a_geometric_guess():
    """n-gram drafts hold or break together: half the runs accept all 4, half none. The first draft's
    rate is 0.5, yet a row's 4 drafts are worth 2 tokens (a geometric model would say 0.94)."""
    p = AdaptivePolicy(4)
    for i in range(400):
        p.observe_acceptance("a", 4, 4 if i % 2 else 0)
    assert p.gains(["a"])[0, 4] == pytest.approx(2.0, rel=0.03)


def test_plain_cost_is_measured_first_then_larger_sizes_are_tried():
    p = AdaptivePolicy(4, explore=0)
    with_acceptance(p, "a", 0.9)
    assert p.choose(["a"], [4]) == [0]  # plain decoding's cost at this load is not known yet
    p.observe_step(1, 0.5)  # a size's first step is not used (first-use work)
    assert p.choose(["a"], [4]) == [0] and p.probing
    p.observe_step(1, 0.01)
    assert p.choose(["a"], [4]) == [4]  # 5 tokens never measured: assumed as cheap as 1, so tried
    p.observe_step(5, 0.5, verify=True)
    assert p.choose(["a"], [4]) == [4]  # its first step does not count
    p.observe_step(5, 0.05, verify=True)  # ... it costs 5x: compute-bound
    assert p.choose(["a"], [4]) == [0] and not p.probing


def test_cost_curve_leans_to_the_lower_envelope():
    c = CostCurve(explore=0)
    c.observe(8, 0.5)  # a first-use outlier: not used
    assert not c.measured(8)
    c.observe(8, 0.3)  # interference: the faster of the first two is kept
    assert c.estimate([8])[0] == pytest.approx(0.3)
    for _ in range(6):
        c.observe(8, 0.01)
    assert c.estimate([8])[0] < 0.02
    before = c.estimate([8])[0]
    c.observe(8, 5.0)  # one slow step moves it a little: it counts at most twice the estimate
    assert c.estimate([8])[0] == pytest.approx(before * 1.1)


def test_a_size_measured_few_times_looks_cheaper_until_sure():
    c = CostCurve(explore=0.2)
    for _ in range(2):
        c.observe(8, 1.0)
    assert c.estimate([8])[0] == pytest.approx(0.8)  # one counted step: 20% off
    for _ in range(3):
        c.observe(8, 1.0)
    assert c.estimate([8])[0] == pytest.approx(0.9)  # four: 10% off


def test_cost_curve_interpolates_and_forgets_stale_buckets():
    c = CostCurve(stale_after=10, explore=0)
    for _ in range(2):  # the first of each is not used
        c.observe(4, 1.0)
        c.observe(16, 4.0)
    # flat below the first point, linear between, past the last at the last stretch's slope (0.25 a
    # unit here; never more than proportional to the size, never less than flat)
    assert list(c.estimate([2, 4, 10, 16, 100])) == pytest.approx([1.0, 1.0, 2.5, 4.0, 25.0])
    for _ in range(10):
        c.observe(16, 4.0)
    assert not c.measured(4) and c.measured(16)  # the 4-token bucket went stale
    c.observe(4, 3.0)  # a fresh measurement replaces a stale one outright (and counts at once)
    assert c.estimate([4])[0] == pytest.approx(3.0)


def test_engine_with_the_policy_is_lossless_and_exports_the_chosen_k(tiny_path):
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from tests.test_speculative import _prompts

    path = tiny_path
    kw = dict(dtype="float32", num_blocks=512, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = _prompts(6, seed=3)
    plain = LLM(path, **kw).generate(prompts, params)
    llm = LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, **kw)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = llm.engine.speculation.policy.stats()
    assert sum(int(v) for v in stats["chosen_k"].values()) > 0 and 0 <= stats["mean_chosen_k"] <= 4
    assert not llm.engine.speculation.policy._acc  # finished requests are forgotten


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    from tests.tiny_vlm import save_tiny_text_model

    return save_tiny_text_model(str(tmp_path_factory.mktemp("tiny")))


def never_drafting(path: str):
    """A speculating LLM whose policy gives every row k = 0 and records when it is asked: (step number,
    rows asked about)."""
    from foveal.engine.llm import LLM

    llm = LLM(
        path, dtype="float32", num_blocks=256, block_size=16,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )  # fmt: skip
    eng = llm.engine
    asked: list[tuple[int, int]] = []
    steps = [0]
    real_step = eng.step

    def counting_step():
        steps[0] += 1
        return real_step()

    eng.step = counting_step
    policy = eng.speculation.policy
    policy.choose = lambda ids, rooms, other=0: asked.append((steps[0], len(ids))) or [0] * len(ids)
    policy.probing = False
    return llm, asked


def test_a_policy_that_gives_no_drafts_rests_for_a_while(tiny_path):
    """When every row gets k = 0 the engine stops asking for REST_STEPS steps (those steps may overlap
    like plain decoding's), then asks again, resting twice as long each time the answer is the same."""
    from foveal import SamplingParams
    from foveal.speculative import driver as driver_mod

    llm, asked = never_drafting(tiny_path)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    gaps = [b[0] - a[0] for a, b in zip(asked, asked[1:])]
    rest = driver_mod._REST_STEPS
    assert gaps[:3] == [rest + 1, 2 * rest + 1, 4 * rest + 1], asked  # each rest twice the last
    # a plain step only to measure plain decoding (probing) is followed by a few more, no longer, and
    # not cut short by the load of an earlier rest (a run's ramp-up after a full batch's rest)
    asked.clear()
    llm.engine.speculation.policy.probing = True
    llm.engine.speculation._rest_rows = 256
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    gaps = [b[0] - a[0] for a, b in zip(asked, asked[1:])]
    assert gaps and set(gaps) == {driver_mod._PROBE_STEPS + 1}, asked


def test_prometheus_counts_the_chosen_k():
    from prometheus_client import generate_latest

    from foveal.metrics import StepReport
    from foveal.metrics.prometheus import PrometheusSink

    m = PrometheusSink()
    base = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    m.step(StepReport(1, 0, 0.1, spec={**base, "chosen_k": {"0": 3, "4": 2}}))
    m.step(StepReport(1, 0, 0.1, spec={**base, "chosen_k": {"0": 5, "4": 2, "2": 1}}))
    text = generate_latest(m.registry).decode()
    assert 'foveal_spec_decode_chosen_k_total{k="0"} 5.0' in text
    assert 'foveal_spec_decode_chosen_k_total{k="4"} 2.0' in text
    assert 'foveal_spec_decode_chosen_k_total{k="2"} 1.0' in text


def test_a_rest_ends_when_the_running_requests_halve(tiny_path):
    from foveal import SamplingParams
    from foveal.speculative import driver as driver_mod

    llm, asked = never_drafting(tiny_path)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 60)]
    llm.generate([[5, 6, 7, 5, 6, 7]] * 4, params)
    (first_step, rows), (second_step, rows_after) = asked[0], asked[1]
    assert rows == 4 and rows_after == 1  # asked again once three of the four had finished ...
    assert second_step - first_step < driver_mod._REST_STEPS  # ... before the rest would have ended


def test_a_verify_step_does_not_stand_in_for_plain_decoding():
    """At batch 64 a verify step of 256 tokens (4 per row) and at batch 256 a plain step of 256 rows
    fall in one size bucket but do not cost the same (H200: 13-15 ms against 11 ms); a plain size
    never measured is not taken from a larger one either. Either way: measure plain decoding first."""
    p = AdaptivePolicy(4, explore=0)
    with_acceptance(p, "a", 1.0)
    for _ in range(4):
        p.observe_step(256, 0.014, verify=True)  # batch 64, 3 drafts a row
        p.observe_step(320, 0.018)  # a plain step of 320 rows
    assert p.choose(["a"] * 256, [4] * 256) == [0] * 256 and p.probing
    for _ in range(2):
        p.observe_step(256, 0.011)
    p.choose(["a"] * 256, [4] * 256)
    assert not p.probing


def h200_ms(n: float) -> float:
    """A decode step's milliseconds by scheduled tokens on the H200 (bf16 Llama-3.1-8B), as the oracle
    benchmark measured them: flat while bandwidth-bound, CUDA graphs up to 256 tokens, eager past it;
    past 1280 tokens at the last stretch's slope."""
    xs, ys = zip(*[(1, 3.3), (32, 3.5), (64, 4.93), (128, 8.46), (256, 11.0), (320, 18.1), (1280, 68.8)])
    if n > xs[-1]:
        return ys[-1] + (n - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return float(np.interp(n, xs, ys))


def test_a_size_far_past_the_measured_ones_is_not_assumed_cheap():
    """Batch 256 after batch 64 (the H200 oracle run): plain steps measured up to 256 rows, verify
    steps up to 320 tokens. Flat past 320 tokens, a 1280-token verify step looked like 18 ms (it costs
    69) and beat plain decoding's 11 ms for 256 tokens: 0.90x. Extended from the last stretch it is
    dearer than plain decoding even at 100% acceptance, so it is not tried; at batch 1, with one plain
    point and nothing else, a verify step is assumed as cheap as a plain one, so drafting is tried."""
    p = AdaptivePolicy(4, explore=0)
    with_acceptance(p, "a", 1.0)
    for _ in range(2):
        for n in (1, 8, 32, 64, 128, 192, 256):
            p.observe_step(n, h200_ms(n) / 1e3)
        for n in (40, 128, 192, 256, 320):
            p.observe_step(n, h200_ms(n) / 1e3, verify=True)
    assert p.step_seconds([1280], 256)[0] > 0.06
    assert p.choose(["a"] * 256, [4] * 256) == [0] * 256 and not p.probing
    # batch 64: 3 drafts a row (256 tokens, the CUDA-graph path: 11 ms) beat 4 (320 eager, 18 ms)
    assert p.choose(["a"] * 64, [4] * 64) == [3] * 64
    fresh = AdaptivePolicy(4, explore=0)
    with_acceptance(fresh, "a", 0.7)
    for _ in range(2):
        fresh.observe_step(1, 0.0033)
    assert fresh.choose(["a"], [4]) == [4]
    for _ in range(2):  # batch 1: a verify step of 5 tokens costs 5.3 ms against 3.3 plain; still pays
        fresh.observe_step(5, 0.0053, verify=True)
    assert fresh.choose(["a"], [4])[0] >= 3  # 70%: 2.5-2.8 tokens a step
    with_acceptance(fresh, "b", 1.0)
    assert fresh.choose(["b"], [4]) == [4]


# -- the engine on a simulated device: a virtual clock, H200-like step costs, host work per step ------


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


# host milliseconds of a step's launch and of its collection: (per step, per row). "light" puts a 5-token
# verify step at batch 1 at 1.24x a plain step (the H200 oracle measured 1.28x) and gives the oracle's
# batch 1 and 8 speedups (sim 3.8-4.1x / 2.3x / 1.35-1.45x at 100/70/40%, H200 3.6-4.0x / 2.0-2.3x /
# 1.2-1.4x); "heavy" makes that verify step 5.3 ms against 3.3 ms plain; "host-bound" gives a 256-row
# step 10.7 ms of host work against the device's 11 (the H200 oracle timed overlapped 256-row plain
# steps at 11.4-13.7 ms): a step without overlap costs about twice one with
_HOST = {
    "light": ((0.3, 0.002), (0.2, 0.002)),
    "heavy": ((1.0, 0.004), (0.8, 0.003)),
    "host-bound": ((0.3, 0.025), (0.2, 0.015)),
}


class _SimRunner:
    """A runner whose steps cost virtual time: the host's launch and collect work (per step and per
    row), the device's work (h200_ms of the decode tokens, plus 0.025 ms per prompt token: prompt
    chunks run at the GEMMs' rate; a plain batch of 256 x (512 in, 256 out) in 6.4 s, the H200's W2 in
    6.5 s) queued behind the step before. Drafts are accepted one after the other with probability
    `rate` (the oracle proposer's runs)."""

    def __init__(self, clock: _Clock, host: str):
        self.clock, self.rate, self.rng = clock, 1.0, random.Random(0)
        self.launch_ms, self.collect_ms = _HOST[host]
        self.device_free = 0.0
        self.steps: list[tuple[int, int, int]] = []  # (decode tokens, prompt tokens, drafts) per step

    def launch(self, batch, sample=True):
        from types import SimpleNamespace

        items = batch.items
        self.clock.now += (self.launch_ms[0] + self.launch_ms[1] * len(items)) / 1e3
        decode = sum(x.num_tokens for x in items if x.is_decode)
        prompt = sum(x.num_tokens for x in items if not x.is_decode)
        start = max(self.clock.now, self.device_free)
        self.device_free = start + (h200_ms(decode) + 0.025 * prompt) / 1e3
        tokens = {}
        for x in items:
            if x.num_logits:
                a = 0
                while a < x.num_drafts and self.rng.random() < self.rate:
                    a += 1
                tokens[x.request_id] = [7] * (a + 1)
        self.steps.append((decode, prompt, sum(x.num_drafts for x in items)))
        return SimpleNamespace(batch=batch, end=self.device_free, tokens=tokens, rows=len(items))

    def collect(self, launched):
        from foveal.worker.model_runner import RunnerOutput

        ms = self.collect_ms[0] + self.collect_ms[1] * launched.rows
        self.clock.now = max(self.clock.now, launched.end) + ms / 1e3
        return RunnerOutput(tokens={r: list(t) for r, t in launched.tokens.items()})

    def sample(self, launched, masks=None):
        pass

    def release(self, ids):
        pass


class _SimProposer:
    num_speculative_tokens = 4
    tap = None

    def propose(self, rows):
        return [[7] * min(r.max_drafts, 4) for r in rows]

    def accepted(self, request_id, num_drafts, num_accepted):
        pass

    def finish(self, request_id):
        pass


class _Detok:
    def decode(self, ids, **kw):
        return "x" * len(ids)


def _sim_engine(clock: _Clock, speculate: bool, host: str = "light", prefix_caching: bool = False):
    """The real engine, scheduler and policy (async scheduling on, a 2048-token budget, 256 seats) on
    the simulated runner."""
    from types import SimpleNamespace

    from foveal.cache.kv_cache_manager import KVCacheManager
    from foveal.config import SchedulerConfig
    from foveal.engine.engine import Engine
    from foveal.engine.input_processor import EngineInfo
    from foveal.sched.scheduler import Scheduler
    from foveal.structured.driver import GuideDriver

    config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)
    sched = Scheduler(config, KVCacheManager(16384, 16, prefix_caching), 1024)
    runner = _SimRunner(clock, host)
    driver = None
    if speculate:
        driver = SpeculationDriver(
            _SimProposer(), method="sim", adaptive=True, scheduler=sched, runner=runner, max_model_len=1024
        )
    return Engine(
        SimpleNamespace(speculative=None), EngineInfo("sim", 1000, 1024, 1024, frozenset()), model=None,
        tokenizer=_Detok(), scheduler=sched, runner=runner, guides=GuideDriver("cpu"), speculation=driver,
        async_scheduling=True,
    )  # fmt: skip


def _sim_run(eng, clock: _Clock, batch: int, rate: float, seed: int = 0, prompts=None) -> float:
    """`batch` requests of 512 prompt tokens (`prompts`: theirs) and 256 output tokens, all at once (the
    oracle benchmark): output tokens per virtual second."""
    from foveal import SamplingParams
    from foveal.request import EngineRequest

    eng.runner.rate, eng.runner.rng, eng.runner.steps = rate, random.Random(seed), []
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    t0, n = clock.now, 0
    for i in range(batch):
        prompt = tuple(prompts[i]) if prompts else (5,) * 512
        eng.add_request(EngineRequest(f"{batch}-{rate}-{seed}-{i}-{t0}", prompt, params))
    while eng.has_unfinished():
        n += sum(len(d.token_ids) for d in eng.step())
    assert n == batch * 256
    return n / (clock.now - t0)


@pytest.fixture
def sim_clock(monkeypatch):
    from types import SimpleNamespace

    from foveal.engine import engine as engine_mod
    from foveal.speculative import driver as driver_mod

    clock = _Clock()
    for mod in (engine_mod, driver_mod):  # the step's phases, and the driver's step costs
        monkeypatch.setattr(mod, "time", SimpleNamespace(perf_counter=clock))
    return clock


def test_simulated_h200_first_runs_at_each_load_keep_up_with_plain_decoding(sim_clock):
    """Issue 19's floor on a simulated H200: one engine taken from batch 1 to 8, 64 and 256 as the
    oracle benchmark does, each load's first run at each acceptance rate (the one that pays for
    exploration, its acceptance figure still the previous rate's) against plain decoding. At batch 256
    the ramp-up (256 prompts of 512 tokens through a 2048-token budget) is most of the run. Before the
    fixes batch 256 at 100% made 0.95x here (drafts in steps whose budget prompt chunks fill,
    1280-token verify steps taken for cheap, plain decoding's cost read from verify steps and from a
    rest's first step, which times host work only)."""
    clock = sim_clock
    plain, spec = _sim_engine(clock, False), _sim_engine(clock, True)
    got = {}
    for batch in (1, 8, 64, 256):
        base = _sim_run(plain, clock, batch, 1.0)
        for rate in (1.0, 0.7, 0.4):
            got[batch, rate] = round(_sim_run(spec, clock, batch, rate) / base, 3)
    assert got[1, 1.0] > 3 and got[1, 0.7] > 2 and got[1, 0.4] > 1.2, got
    assert got[8, 1.0] > 2.5 and got[8, 0.7] > 1.5 and got[8, 0.4] > 1.1, got
    assert min(got.values()) >= 0.97, got


def test_simulated_batch_256_first_runs_with_dear_host_work(sim_clock):
    """The same at batch 64 and 256 with host work that makes a verify step at batch 1 cost 5.3 ms
    against 3.3 ms plain (every step that asks the policy runs without overlap). Before the fixes:
    batch 64 0.94x / 0.96x at 70% / 40%, batch 256 0.89x / 0.97x / 0.98x."""
    clock = sim_clock
    plain, spec = _sim_engine(clock, False, "heavy"), _sim_engine(clock, True, "heavy")
    got = {}
    for batch in (64, 256):
        base = _sim_run(plain, clock, batch, 1.0)
        for rate in (1.0, 0.7, 0.4):
            got[batch, rate] = round(_sim_run(spec, clock, batch, rate) / base, 3)
    assert min(got.values()) >= 0.97, got


def test_simulated_rests_time_plain_steps_at_their_device_cost(sim_clock):
    """A rest's plain steps overlap: each is timed until the step in flight before it is collected, one
    device step. The first one of a rest has none in flight (the step that asked the policy collected
    its own): its interval is host work only and must not lower plain decoding's figure."""
    eng = _sim_engine(sim_clock, True, "heavy")
    eng.speculation.policy.choose = lambda ids, rooms, other=0: [0] * len(ids)  # never drafts: always resting
    _sim_run(eng, sim_clock, 64, 1.0)
    est = eng.speculation.policy.plain_cost.estimate([64])[0] * 1e3
    assert est == pytest.approx(h200_ms(64), rel=0.1), est  # device-bound: the device step


def test_simulated_prompt_chunks_that_fill_the_budget_take_no_drafts(sim_clock):
    """While prompts fill the token budget past the decode rows a draft only takes a prompt token's
    place: those steps are plain ones, overlapped, and the policy is not asked."""
    eng = _sim_engine(sim_clock, True)
    asked = []
    real = eng.speculation.policy.choose
    eng.speculation.policy.choose = lambda ids, rooms, other=0: (
        asked.append(len(eng.scheduler.waiting)) or real(ids, rooms, other)
    )
    _sim_run(eng, sim_clock, 256, 1.0)
    steps = eng.runner.steps
    assert all(not drafts for decode, prompt, drafts in steps if decode + prompt >= 2048)
    assert sum(1 for decode, prompt, _ in steps if decode + prompt >= 2048) > 50  # the ramp-up
    assert asked.count(0) == len(asked)  # asked only once every prompt was admitted


def test_simulated_batch_256_without_drafts_runs_like_plain_decoding(sim_clock):
    """The H200 oracle at batch 256 (one engine, the same 256 prompts run after run, so the prefix
    cache admits them all in a few steps; the plain engine after each run): the policy never drafts,
    yet the speculating engine made 0.92-0.99x. Each of the run's asks (five: rests of 16, 32, 64 and
    128 steps, the streak restarting with each run's new requests) waited for the step in flight and
    then for its own tokens, and with host work about as long as the device's a step without overlap
    costs about twice one with: 0.96x here before the fix. Asked with the step in flight, an answer of
    k = 0 is a plain step that overlaps like any other: the engine runs as plain decoding does."""
    clock = sim_clock
    plain = _sim_engine(clock, False, "host-bound", prefix_caching=True)
    spec = _sim_engine(clock, True, "host-bound", prefix_caching=True)
    policy = spec.speculation.policy  # what batch 64 taught it (plain 256 rows not yet measured)
    with_acceptance(policy, "64", 0.4)
    for _ in range(2):
        for n in (1, 8, 32, 64, 128):
            policy.observe_step(n, h200_ms(n) / 1e3)
        for n in (40, 128, 192, 256, 320):
            policy.observe_step(n, h200_ms(n) / 1e3, verify=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(512)] for _ in range(256)]
    got, sync, asks = [], [], []
    for rate, rep in itertools.product((1.0, 0.7, 0.4), range(2)):
        s = _sim_run(spec, clock, 256, rate, rep, prompts)
        got.append(round(s / _sim_run(plain, clock, 256, rate, rep, prompts), 3))
        if spec.speculation is not None:  # steps that waited, and the policy's answers, per run
            sync.append(dict(spec.speculation.sync))
            asks.append(dict(spec.speculation.asks))
            spec.speculation.sync.clear()
            spec.speculation.asks.clear()
    assert min(got) >= 0.995, got  # before: 0.965-0.977
    # the first run probes plain decoding at 256 rows and explores a verify step or two as the last
    # requests finish; after it no step waits, and every answer is a rest (k = 0) given with a step
    # in flight
    assert all(not s for s in sync[1:]), sync
    assert all(set(a) == {"rest"} for a in asks[1:]), asks
