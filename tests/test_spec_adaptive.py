"""The load-aware speculation policy (foveal.spec.adaptive): its choices against a brute-force optimum of
the same objective on cost curves fed to it, its acceptance counting, its exploration, and an engine
with it on (greedy output equal to plain decoding whatever k it picks; the chosen k exported)."""

from __future__ import annotations

import itertools
import random

import pytest

from foveal.spec.adaptive import AdaptivePolicy, CostCurve


def fed(policy: AdaptivePolicy, step, draft=lambda rows: 0.0, sizes=range(1, 2049)) -> AdaptivePolicy:
    """Teach the policy a step-cost curve (seconds by scheduled tokens) and a draft-cost curve (built
    with stale_after large enough that none of it is forgotten)."""
    for _ in range(2):  # a size's first step is not used
        for n in sizes:
            policy.observe_step(n, step(n))
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
    p.observe_step(5, 0.5)
    assert p.choose(["a"], [4]) == [4]  # its first step does not count
    p.observe_step(5, 0.05)  # ... it costs 5x: compute-bound
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
    assert list(c.estimate([2, 4, 10, 16, 100])) == pytest.approx([1.0, 1.0, 2.5, 4.0, 4.0])
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
    stats = llm.engine.spec_policy.stats()
    assert sum(int(v) for v in stats["chosen_k"].values()) > 0 and 0 <= stats["mean_chosen_k"] <= 4
    assert not llm.engine.spec_policy._acc  # finished requests are forgotten


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
    eng.spec_policy.choose = lambda ids, rooms, other=0: asked.append((steps[0], len(ids))) or [0] * len(ids)
    eng.spec_policy.probing = False
    return llm, asked


def test_a_policy_that_gives_no_drafts_rests_for_a_while(tiny_path):
    """When every row gets k = 0 the engine stops asking for REST_STEPS steps (those steps may overlap
    like plain decoding's), then asks again, resting twice as long each time the answer is the same."""
    from foveal import SamplingParams
    from foveal.engine import engine as engine_mod

    llm, asked = never_drafting(tiny_path)
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    gaps = [b[0] - a[0] for a, b in zip(asked, asked[1:])]
    rest = engine_mod._REST_STEPS
    assert gaps[:3] == [rest + 1, 2 * rest + 1, 4 * rest + 1], asked  # each rest twice the last
    # a plain step only to measure plain decoding (probing) is followed by a few more, no longer
    asked.clear()
    llm.engine.spec_policy.probing = True
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    gaps = [b[0] - a[0] for a, b in zip(asked, asked[1:])]
    assert gaps and set(gaps) == {engine_mod._PROBE_STEPS + 1}, asked


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
    from foveal.engine import engine as engine_mod

    llm, asked = never_drafting(tiny_path)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 8, 8, 60)]
    llm.generate([[5, 6, 7, 5, 6, 7]] * 4, params)
    (first_step, rows), (second_step, rows_after) = asked[0], asked[1]
    assert rows == 4 and rows_after == 1  # asked again once three of the four had finished ...
    assert second_step - first_step < engine_mod._REST_STEPS  # ... before the rest would have ended
