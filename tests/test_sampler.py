"""Sampler against a deliberately plain per-row reference, plus invariants (seeding, padding, dtypes).

CPU only, no model. The reference below loops over rows and tokens one at a time and shares no code
with foveal.sample.sampler, so a vectorisation mistake there shows up as a mismatch here.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from foveal.request import SamplingParams
from foveal.sample.sampler import Sampler, SamplingRow

V = 64
NEG_INF = float("-inf")


# ---- the reference ------------------------------------------------------------------------------------


def ref_process(logits_row: torch.Tensor, row: SamplingRow, vocab: int = V) -> torch.Tensor:
    x = logits_row[:vocab].to(torch.float32).clone()
    p = row.params
    if len(row.output_token_ids) < p.min_tokens:
        for t in p.stop_token_ids:
            x[t] = NEG_INF
        if not p.ignore_eos:
            for t in row.eos_token_ids:
                x[t] = NEG_INF
    for t, b in (p.logit_bias or {}).items():
        x[t] = x[t] + b
    if p.repetition_penalty != 1.0:
        for t in set(row.prompt_token_ids) | set(row.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(row.output_token_ids):
        c = row.output_token_ids.count(t)
        x[t] = x[t] - (p.frequency_penalty * c + p.presence_penalty)
    return x


def ref_filter(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = x / p.temperature
    n = x.numel()
    if p.min_p > 0:
        probs = torch.softmax(x, 0)
        top = probs.max().item()
        for t in range(n):
            if probs[t].item() < p.min_p * top:
                x[t] = NEG_INF
    if 0 < p.top_k < n:
        order = sorted(range(n), key=lambda t: -x[t].item())
        for t in order[p.top_k :]:
            x[t] = NEG_INF
    if p.top_p < 1.0:
        probs = torch.softmax(x, 0)
        order = sorted(range(n), key=lambda t: -probs[t].item())
        kept, cum = set(), 0.0
        for t in order:
            kept.add(t)
            cum += probs[t].item()
            if cum >= p.top_p:
                break
        for t in range(n):
            if t not in kept:
                x[t] = NEG_INF
    return x


# ---- helpers ------------------------------------------------------------------------------------------


def row(prompt=(1, 2, 3), output=(), eos=(0,), **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), frozenset(eos))


def rand_logits(b: int, v: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def mixed_rows() -> list[SamplingRow]:
    return [
        row(temperature=0.0),
        row(temperature=0.0, repetition_penalty=1.7, output=[5, 9, 9]),
        row(temperature=0.8, presence_penalty=0.9, frequency_penalty=0.4, output=[3, 3, 3, 7, 11]),
        row(temperature=1.0, repetition_penalty=0.6, presence_penalty=-0.5, prompt=[4, 4, 20], output=[21]),
        row(temperature=1.3, min_p=0.15, logit_bias={2: 5.0, 6: -100.0}),
        row(temperature=0.7, top_k=5, frequency_penalty=1.2, output=[1, 1, 2]),
        row(temperature=1.1, top_p=0.6, top_k=12, min_p=0.02),
        row(temperature=0.9, top_p=0.85, min_tokens=4, output=[1], eos=(0, 13), stop_token_ids=[17]),
    ]


# ---- steps 1-6 against the reference ------------------------------------------------------------------


def test_processed_logits_match_reference():
    rows = mixed_rows()
    logits = rand_logits(len(rows))
    got = Sampler(V).process_logits(logits, rows)
    assert got.dtype == torch.float32 and got.shape == (len(rows), V)
    for i, r in enumerate(rows):
        want = ref_process(logits[i], r)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    # the penalties really moved something (the test would be vacuous otherwise)
    assert not torch.allclose(got[1:4], logits[1:4])


def test_device_history_counts_what_the_lists_count():
    """Penalty rows with a history slot (started once from the lists, then counting each drawn token
    on the device) process their logits exactly as rows that count the host lists, step after step,
    slots reused by a new request included."""
    s = Sampler(V, "cpu")
    rows = [r for r in mixed_rows() if r.params.needs_penalties]
    assert len(rows) >= 3
    for i, r in enumerate(rows):
        s.history.start(i + 3, r.prompt_token_ids, r.output_token_ids, r.params.repetition_penalty != 1.0)
    for step in range(6):
        logits = rand_logits(len(rows), seed=10 + step)
        listed = Sampler(V).process_logits(logits, rows)
        slotted = [SamplingRow(r.params, [], [], r.eos_token_ids, len(r.output_token_ids), i + 3)
                   for i, r in enumerate(rows)]  # fmt: skip
        assert torch.equal(s.process_logits(logits, slotted), listed), step
        tokens, _ = s.sample(logits, slotted)
        s.count(slotted, tokens)
        for r, t in zip(rows, tokens.tolist()):
            r.output_token_ids.append(t)
    # slot 3 taken by a new request: its counts start over
    s.history.start(3, [9], [], True)
    assert s.history.counts[3].sum() == 0 and s.history.prompt[3].nonzero().flatten().tolist() == [9]


@pytest.fixture(params=[2, 4, 16, 1 << 20], ids=["window2+32", "window4", "window16", "no-window"])
def window(request, monkeypatch):
    """The torch path's top_p candidates (sampler.TOP_P_WINDOW): 2 then 32 (two windows, rows sorted
    whole after either), few (most rows sorted whole), some, and the whole vocabulary."""
    from foveal.sample import sampler

    monkeypatch.setattr(sampler, "TOP_P_WINDOW", request.param)
    return request.param


def test_filtered_distributions_match_reference(window):
    rows = mixed_rows()
    logits = rand_logits(len(rows), seed=1)
    got = Sampler(V).filtered_logits(logits, rows)
    for i, r in enumerate(rows):
        if r.params.greedy:
            continue
        want = ref_filter(ref_process(logits[i], r), r.params)
        kept = torch.isfinite(got[i])
        assert torch.equal(kept, torch.isfinite(want)), (i, kept.sum().item(), torch.isfinite(want).sum())
        torch.testing.assert_close(got[i].softmax(0), want.softmax(0), rtol=1e-5, atol=1e-6)
    # each filter actually removed tokens in this batch
    n_kept = torch.isfinite(got).sum(1).tolist()
    assert n_kept[5] == 5 and n_kept[4] < V and n_kept[6] <= 12 and n_kept[7] < V


def test_filters_compose_on_renormalized_distribution():
    """top_p is applied to the top_k-renormalized distribution, not to the full one."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0] + [0.0] * (V - 4)])
    r = row(temperature=1.0, top_k=2, top_p=0.7)
    got = Sampler(V).filtered_logits(logits, [r])
    want = ref_filter(logits[0].clone(), r.params)
    assert torch.equal(torch.isfinite(got[0]), torch.isfinite(want))
    # after top_k=2 the two survivors have probs 0.73/0.27, so top_p=0.7 keeps only the first
    assert torch.isfinite(got[0]).sum().item() == 1


def test_topk_only_and_topp_only_batches(window):
    """The top_k-only path (topk, no sort) and the top_p path agree with the reference."""
    logits = rand_logits(4, seed=2)
    for rows in (
        [row(top_k=3), row(top_k=10), row(), row(top_k=100)],
        [row(top_p=0.5), row(), row(top_p=0.9, top_k=7), row(top_p=0.3, min_p=0.5)],
    ):
        got = Sampler(V).filtered_logits(logits, rows)
        for i, r in enumerate(rows):
            want = ref_filter(logits[i].clone(), r.params)
            assert torch.equal(torch.isfinite(got[i]), torch.isfinite(want)), (rows, i)
            torch.testing.assert_close(got[i].softmax(0), want.softmax(0))


def test_top_p_from_a_window_or_the_whole_row(monkeypatch):
    """top_p (after top_k) decided from each row's TOP_P_WINDOW largest logits where its kept set lies
    among them, else from the sorted row: a peaked row (decided in the window), a flat one (its set
    reaches past it), a top_k larger than the window, a k-th value tied across the window's edge, a
    row with neither filter beside them: each kept set equals the whole sorted rows' (and the
    reference's, which keeps one of the ties where the sampler keeps them all), and a row's result does
    not depend on its batch."""
    from foveal.sample import sampler

    peaked = torch.cat([torch.tensor([9.0, 8.0, 7.5]), torch.zeros(V - 3)])
    flat = rand_logits(1, seed=4, scale=0.01)[0]
    tied = torch.cat([torch.tensor([5.0, 4.0]), torch.full((12,), 3.0), torch.zeros(V - 14)])
    cases = [
        (peaked, row(top_p=0.9)),
        (flat, row(top_p=0.5)),
        (rand_logits(1, seed=5)[0], row(top_k=20, top_p=0.95)),
        (tied, row(top_k=4, top_p=0.99)),  # ties at the 4th value run past the 8 candidates
        (rand_logits(1, seed=6)[0], row()),
        (rand_logits(1, seed=7)[0], row(top_k=3, top_p=0.8)),
    ]
    logits = torch.stack([c[0] for c in cases])
    rows = [c[1] for c in cases]
    whole = Sampler(V).filtered_logits(logits, rows)  # V < the window: every row sorted whole
    monkeypatch.setattr(sampler, "TOP_P_WINDOW", 8)
    calls = []
    real = sampler._kept
    monkeypatch.setattr(sampler, "_kept", lambda vals, *a: calls.append(tuple(vals.shape)) or real(vals, *a))
    got = Sampler(V).filtered_logits(logits, rows)
    # the flat row 1 sorted at once; 0 and 5 decided from 8 candidates, 2 and 3 sorted after them; 4 as is
    assert calls == [(4, 8), (3, V)]
    monkeypatch.setattr(sampler, "_kept", real)
    for i, r in enumerate(rows):
        assert torch.equal(torch.isfinite(got[i]), torch.isfinite(whole[i])), i
        torch.testing.assert_close(got[i].softmax(0), whole[i].softmax(0))
        if i != 3:
            assert torch.equal(
                torch.isfinite(got[i]), torch.isfinite(ref_filter(logits[i].clone(), r.params))
            )
        alone = Sampler(V).filtered_logits(logits[i : i + 1], [r])
        assert torch.equal(alone[0], got[i]), i
    assert torch.isfinite(got[3]).sum().item() == 14  # every tie of the 4th value kept
    assert torch.isfinite(got[1]).sum().item() > 8  # the flat row's set is wider than the window
    assert torch.equal(got[4], logits[4])  # no filter: the row itself


def test_samples_stay_inside_filtered_set():
    torch.manual_seed(0)
    logits = rand_logits(1, seed=3, scale=0.5).repeat(300, 1)
    rows = [row(temperature=2.0, top_k=4) for _ in range(300)]
    allowed = set(logits[0].topk(4).indices.tolist())
    assert set(Sampler(V)(logits, rows).token_ids) <= allowed


# ---- greedy, bias, min_tokens -------------------------------------------------------------------------


def test_greedy_is_argmax_and_fast_path_skips_processing(monkeypatch):
    logits = rand_logits(7, seed=4)
    s = Sampler(V)

    def boom(*a, **k):
        raise AssertionError("fast path must not process logits")

    monkeypatch.setattr(s, "process_logits", boom)
    out = s(logits, [row(temperature=0.0) for _ in range(7)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 7


def test_logit_bias_changes_greedy_choice():
    logits = rand_logits(3, seed=5)
    top = logits.argmax(-1).tolist()
    second = logits.topk(2).indices[:, 1].tolist()
    low = logits.argmin(-1).tolist()
    rows = [
        row(temperature=0.0, logit_bias={low[0]: 100.0}),
        row(temperature=0.0, logit_bias={top[1]: -100.0}),
        row(temperature=0.0),
    ]
    assert Sampler(V)(logits, rows).token_ids == [low[0], second[1], top[2]]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(5, V)
    logits[:, 5] = 10.0  # eos
    logits[:, 7] = 9.0  # stop token
    logits[:, 30] = 1.0
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[7], eos=(5,))
    rows = [
        row(output=[1, 2], **kw),  # still under min_tokens: neither 5 nor 7
        row(output=[1, 2, 3], **kw),  # reached: EOS allowed again
        row(output=[1], ignore_eos=True, **kw),  # ignore_eos: EOS not held back, stop id still is
        row(output=[], **{**kw, "temperature": 1.0}),  # sampled rows are masked too
        row(output=[], temperature=0.0, stop_token_ids=[7], eos=(5,)),  # no min_tokens
    ]
    out = Sampler(V)(logits, rows).token_ids
    assert out[0] == 30 and out[1] == 5 and out[2] == 5 and out[3] not in (5, 7) and out[4] == 5
    masked = Sampler(V).filtered_logits(logits, rows)
    assert masked[0, 5] == NEG_INF and masked[0, 7] == NEG_INF and masked[2, 7] == NEG_INF
    assert torch.isfinite(masked[2, 5]) and torch.isfinite(masked[1, 5]) and torch.isfinite(masked[1, 7])


# ---- the draw -----------------------------------------------------------------------------------------


def test_seeded_rows_ignore_batch_composition_and_position():
    torch.manual_seed(1)
    s = Sampler(V)
    base = rand_logits(1, seed=6, scale=0.3)[0]  # flat-ish, so seeds really matter
    target = row(temperature=1.0, top_p=0.95, seed=1234, output=[3, 4])
    alone = s(base[None], [target]).token_ids[0]
    others = [
        row(temperature=0.0),
        row(temperature=1.5, seed=99),
        row(temperature=0.7, top_k=3),
        row(temperature=1.0, min_p=0.1, seed=7, output=[1]),
        row(temperature=1.0, repetition_penalty=1.3, output=[8]),
        row(temperature=1.0, logprobs=2),
        row(temperature=2.0, top_p=0.5),
    ]
    for trial in range(5):
        rows = others + [target]
        random.Random(trial).shuffle(rows)
        logits = rand_logits(len(rows), seed=100 + trial, scale=0.3)
        pos = rows.index(target)
        logits[pos] = base
        assert s(logits, rows).token_ids[pos] == alone
    # the same seed at the same draw index from a fresh sampler too
    assert Sampler(V)(base[None], [target]).token_ids[0] == alone


def test_seeded_draw_index_and_seed_both_matter():
    s = Sampler(V)
    logits = torch.zeros(1, V)  # uniform
    at0 = [s(logits, [row(seed=k, output=[])]).token_ids[0] for k in range(60)]
    at1 = [s(logits, [row(seed=k, output=[9])]).token_ids[0] for k in range(60)]
    assert sum(a != b for a, b in zip(at0, at1)) > 45
    assert len(set(at0)) > 25


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


def test_unseeded_frequencies_match_softmax():
    torch.manual_seed(2)
    v = 10
    logits = torch.linspace(-1.0, 1.0, v)
    n = 2000
    out = Sampler(v)(logits.repeat(n, 1), [row(temperature=1.5) for _ in range(n)]).token_ids
    probs = torch.softmax(logits / 1.5, 0).tolist()
    # df=9: mean 9, P(chi2 > 40) ~ 1e-5; the RNG is fixed, so this cannot flake
    assert chi_square([out.count(t) for t in range(v)], probs) < 40


def test_seeded_frequencies_over_seeds_match_softmax():
    v = 8
    logits = torch.linspace(0.0, 1.5, v)[None]
    s = Sampler(v)
    out = [s(logits, [row(seed=k)]).token_ids[0] for k in range(1500)]
    probs = torch.softmax(logits[0], 0).tolist()
    assert chi_square([out.count(t) for t in range(v)], probs) < 35  # df=7


# ---- logprobs, padding, dtypes ------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(3)
    rows = [
        row(temperature=0.0, logprobs=0),
        row(temperature=0.5, repetition_penalty=2.0, output=[1, 2], logprobs=3),
        row(temperature=1.0, logprobs=None),
        row(temperature=0.0, logit_bias={9: 50.0}, logprobs=20),
    ]
    logits = rand_logits(len(rows), seed=7)
    out = Sampler(V)(logits, rows)
    lp = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    assert out.token_ids[3] == 9
    for i in (0, 1, 3):
        got = out.logprobs[i]
        k = rows[i].params.logprobs
        assert got.token_id == out.token_ids[i]
        assert math.isclose(got.logprob, lp[i, got.token_id].item(), abs_tol=1e-5)
        assert len(got.top) == k
        if k == 0:
            assert got.top == []
        else:
            assert [t.token_id for t in got.top] == lp[i].topk(k).indices.tolist()
        vals = [t.logprob for t in got.top]
        assert vals == sorted(vals, reverse=True)
        for t in got.top:
            assert math.isclose(t.logprob, lp[i, t.token_id].item(), abs_tol=1e-5)


def test_a_rows_logprobs_do_not_depend_on_the_batch():
    """A row's logprobs are the same bits alone and in batches of any size: torch's CPU logsumexp splits
    a lone row's sum between threads (a batch's rows are each summed whole), which moved logprobs by an
    ulp between a request served alone and batched."""
    vocab, n = 49152 + 7, 24
    logits = rand_logits(n, vocab, seed=11, scale=4.0)
    rows = [row(temperature=0.0, logprobs=2)] * n
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))  # the split needs two threads at least
    try:
        s = Sampler(vocab)
        alone = [s(logits[i : i + 1], rows[:1]).logprobs[0] for i in range(n)]
        for size in (2, 5, n):
            assert s(logits[:size], rows[:size]).logprobs == alone[:size], size
    finally:
        torch.set_num_threads(threads)
    lp = torch.log_softmax(logits.double(), -1)
    for i, got in enumerate(alone):
        assert math.isclose(got.logprob, lp[i, got.token_id].item(), abs_tol=2e-6)


def test_padding_columns_are_never_chosen():
    torch.manual_seed(4)
    logits = torch.cat([rand_logits(5, seed=8), torch.full((5, 16), 1e4)], dim=1)
    rows = [
        row(temperature=0.0),
        row(temperature=1.0, logprobs=5),
        row(temperature=2.0, seed=3),
        row(temperature=0.0, logprobs=2),
        row(temperature=1.0, top_p=0.9, repetition_penalty=1.2, output=[70]),  # out-of-vocab history id
    ]
    s = Sampler(V)
    out = s(logits, rows)
    assert all(t < V for t in out.token_ids)
    assert s(logits, [row(temperature=0.0)] * 5).token_ids == logits[:, :V].argmax(-1).tolist()
    lp = torch.log_softmax(logits[:, :V], -1)
    for i in (1, 3):
        assert all(t.token_id < V for t in out.logprobs[i].top)
        assert math.isclose(out.logprobs[i].logprob, lp[i, out.token_ids[i]].item(), abs_tol=1e-5)


def test_bf16_logits():
    torch.manual_seed(5)
    rows = mixed_rows() + [row(temperature=0.0, logprobs=4)]
    logits = rand_logits(len(rows), seed=9).to(torch.bfloat16)
    out = Sampler(V)(logits, rows)
    assert out.token_ids[0] == logits[0].float().argmax().item()
    lp = torch.log_softmax(logits[-1].float(), -1)
    assert math.isclose(out.logprobs[-1].logprob, lp[out.token_ids[-1]].item(), abs_tol=1e-5)
    want = torch.stack([ref_process(logits[i], r) for i, r in enumerate(rows)])
    torch.testing.assert_close(Sampler(V).process_logits(logits, rows), want, rtol=1e-6, atol=1e-6)


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError):
        Sampler(V)(torch.zeros(2, V - 1), [row(), row()])


def test_a_kernel_that_fails_to_build_falls_back_alone(monkeypatch):
    """Each Triton kernel builds at its first launch: one that fails there is left for the torch ops
    from then on, whatever the others did; one that built and then fails raises (no silent fallback)."""
    from foveal.sample import sampler

    monkeypatch.setattr(sampler, "_kernel_ok", {"penalize": True})
    calls = []

    def broken(ts):
        calls.append(1)
        raise RuntimeError("no compiler")

    assert sampler._triton("sample", broken) is None and sampler._triton("sample", broken) is None
    assert len(calls) == 1 and sampler._kernel_ok == {"penalize": True, "sample": False}
    with pytest.raises(RuntimeError):
        sampler._triton("penalize", broken)
