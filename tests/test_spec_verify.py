"""Speculative decoding: rejection.verify keeps the target distribution, and NgramIndex proposes right.

CPU only, no model. Greedy verification is checked row by row against the argmax. The sampled path is
checked statistically: many trials batched as items of one call, on a 6-token vocabulary with fixed
target and draft rows, and every output position's distribution (given the drafts before it were
accepted) is compared with the target's row, by a chi-square test where scipy is installed and by a
total-variation bound from the sample count in any case. NgramIndex is compared with a brute-force scan.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from foveal.request import SamplingParams
from foveal.sample.sampler import Sampler, SamplingRow
from foveal.speculative.ngram import NgramIndex
from foveal.speculative.rejection import probs_of, verify

try:
    from scipy.stats import chisquare
except ImportError:  # the TV bound below still holds the tests to the target distribution
    chisquare = None

V = 6
NEG_INF = float("-inf")


def _layout(num_drafts: list[int]) -> list[int]:
    """First row of each item."""
    starts, r = [], 0
    for k in num_drafts:
        starts.append(r)
        r += k + 1
    return starts


def _drafts_row(drafts: list[list[int]]) -> torch.Tensor:
    """draft_ids [R] from per-item draft lists: row j judges drafts[j], the bonus row gets -1."""
    return torch.tensor([t for d in drafts for t in [*d, -1]], dtype=torch.long)


def _greedy(logits: torch.Tensor, drafts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    k = [len(d) for d in drafts]
    n = len(k)
    return verify(logits, _drafts_row(drafts), k, [True] * n, [None] * n, [0] * n)


# ---- greedy -----------------------------------------------------------------------------------------


def test_greedy_accepts_matching_drafts_and_adds_the_bonus():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    top = logits.argmax(-1).tolist()
    tokens, acc = _greedy(logits, [top[:3]])
    assert acc.tolist() == [3]
    assert acc.dtype == tokens.dtype == torch.long
    assert tokens.tolist() == top  # the three drafts, then the bonus row's argmax


@pytest.mark.parametrize("j", [0, 1, 2])
def test_greedy_mismatch_accepts_the_prefix_and_corrects(j):
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    top = logits.argmax(-1).tolist()
    drafts = top[:3]
    drafts[j] = (drafts[j] + 1) % 50
    if j < 2:
        drafts[j + 1] = (drafts[j + 1] + 7) % 50  # rows after the rejection do not matter either way
    tokens, acc = _greedy(logits, [drafts])
    assert acc.tolist() == [j]
    assert tokens[: j + 1].tolist() == top[: j + 1]
    assert all(0 <= t < 50 for t in tokens.tolist())


def test_greedy_no_drafts_and_mixed_items():
    torch.manual_seed(2)
    ks = [0, 2, 0, 3, 1]
    logits = torch.randn(sum(ks) + len(ks), 40)
    top = logits.argmax(-1).tolist()
    starts = _layout(ks)
    wrong_at = {1: 1, 3: 0}  # item -> first draft that misses; item 4 matches fully
    drafts = []
    for i, (k, s) in enumerate(zip(ks, starts)):
        d = top[s : s + k]
        if i in wrong_at:
            d[wrong_at[i]] = (d[wrong_at[i]] + 3) % 40
        drafts.append(d)
    tokens, acc = _greedy(logits, drafts)
    want = [wrong_at.get(i, k) for i, k in enumerate(ks)]
    assert acc.tolist() == want
    for s, a in zip(starts, want):
        assert tokens[s : s + a + 1].tolist() == top[s : s + a + 1]


def test_draft_outside_the_vocab_is_rejected():
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    top = logits.argmax(-1).tolist()
    tokens, acc = _greedy(logits, [[top[0], -1]])
    assert acc.tolist() == [1] and tokens[:2].tolist() == top[:2]
    p = probs_of(logits)
    tokens, acc = verify(logits, torch.tensor([10, 0, -1]), [2], [False], [None], [0], draft_probs=p)
    assert acc.tolist() == [0] and 0 <= tokens[0].item() < 10


def test_bad_arguments():
    logits = torch.randn(3, 5)
    with pytest.raises(ValueError, match="logits"):
        verify(logits, torch.zeros(3, dtype=torch.long), [1], [True], [None], [0])
    with pytest.raises(ValueError, match="num_drafts"):
        verify(logits, torch.zeros(3, dtype=torch.long), [2], [True, False], [None], [0])
    with pytest.raises(ValueError, match="draft_ids"):
        verify(logits, torch.zeros(2, dtype=torch.long), [2], [True], [None], [0])
    with pytest.raises(ValueError, match="draft_probs"):
        verify(logits, torch.zeros(3, dtype=torch.long), [2], [False], [None], [0], torch.ones(3, 4))


# ---- the sampled path keeps the target distribution -------------------------------------------------

TRIALS = 20_000


def _rows(seed: int, k: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(k + 1, V, generator=g) * scale


def _trials(
    target: torch.Tensor, q: torch.Tensor | None, fixed: list[int] | None, seeded: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRIALS items of one call, every item with the same target rows (and draft rows q); drafts drawn
    from q, or the fixed list when the proposer is deterministic; seeded: item i has seed i. Returns
    (outputs [TRIALS, k+1], num_accepted [TRIALS])."""
    k = target.shape[0] - 1
    logits = target.repeat(TRIALS, 1)
    if fixed is None:
        d = torch.multinomial(q[:k], TRIALS, replacement=True).T  # [TRIALS, k]: d_j ~ q_j
        draft_probs = q.repeat(TRIALS, 1)
    else:
        d = torch.tensor(fixed, device=target.device).repeat(TRIALS, 1)
        draft_probs = None
    n = TRIALS
    seeds = list(range(n)) if seeded else [None] * n
    tokens, acc = verify(logits, _with_bonus(d), [k] * n, [False] * n, seeds, [0] * n, draft_probs)
    return tokens.view(TRIALS, k + 1), acc


def _tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def _tv_bound(p: torch.Tensor, n: int) -> float:
    """0.5 * sum of 4 standard deviations of the empirical frequencies: an n-sample histogram of p
    exceeds it with probability far below 1e-3 (its expected TV is about a fifth of it)."""
    return 0.5 * sum(4 * math.sqrt(max(x, 0.0) * (1 - x) / n) for x in p.tolist())


def _check_matches(samples: torch.Tensor, p: torch.Tensor) -> float:
    n = samples.numel()
    freq = torch.bincount(samples, minlength=V).double() / n
    tv = _tv(freq, p.double())
    assert tv < _tv_bound(p, n), (tv, _tv_bound(p, n), freq.tolist(), p.tolist())
    if chisquare is not None:
        keep = p > 0
        assert freq[~keep].sum() == 0, "a token outside the target's support was emitted"
        obs = (freq[keep] * n).tolist()
        exp = (p.double()[keep] / p.double()[keep].sum() * n).tolist()
        assert chisquare(obs, exp).pvalue > 1e-4
    return tv


@pytest.mark.parametrize("proposer,seeded", [("probs", False), ("one_hot", False), ("probs", True)])
def test_sampled_outputs_follow_the_target(proposer, seeded):
    torch.manual_seed(1234)
    k = 3
    base = _rows(10, k, 1.5)
    target = base.clone()
    target[2, 4] = NEG_INF  # a filtered token: the output must never contain it
    p = probs_of(target)
    if proposer == "probs":
        q = probs_of(base + _rows(11, k, 1.5))  # a rough draft: TV(p_j, q_j) 0.2 .. 0.7, q_2(4) > 0
        fixed = None
        overlap = torch.minimum(p[0], q[0])
        naive_first = overlap + (1 - overlap.sum()) * p[0]
    else:
        q = None
        fixed = p[:k].argmax(-1).tolist()
        d0 = fixed[0]
        naive_first = (1 - p[0, d0]) * p[0]
        naive_first[d0] += p[0, d0]
    out, acc = _trials(target, q, fixed, seeded)
    assert acc.min() >= 0 and acc.max() <= k
    assert ((out >= 0) & (out < V)).all()
    # (a) the first token is distributed as p_0; and the bound is tight enough to catch a verifier that
    # draws from p_0 again on rejection instead of from the residual
    assert _tv(naive_first, p[0]) > 2 * _tv_bound(p[0], TRIALS)
    _check_matches(out[:, 0], p[0])
    # (b) given drafts 1..j accepted, output j is distributed as p_j (j = 1: the second output token)
    for j in range(1, k + 1):
        given = out[acc >= j, j]
        assert given.numel() > 500, (j, given.numel())
        _check_matches(given, p[j])
    if fixed is not None:  # the residual never re-emits a rejected draft
        assert ((acc >= 1) == (out[:, 0] == fixed[0])).all()


def test_a_draft_the_target_filtered_out_is_always_rejected():
    torch.manual_seed(6)
    n = 500
    target = torch.randn(2, V)
    target[0, 3] = NEG_INF
    logits = target.repeat(n, 1)
    d = torch.tensor([3, -1]).repeat(n)
    tokens, acc = verify(logits, d, [1] * n, [False] * n, [None] * n, [0] * n)
    assert (acc == 0).all()
    assert (tokens.view(n, 2)[:, 0] != 3).all()


def _with_bonus(d: torch.Tensor) -> torch.Tensor:
    """[n, k] drafts -> draft_ids [n * (k + 1)] with -1 on every bonus row."""
    return torch.cat([d, torch.full((d.shape[0], 1), -1, device=d.device)], 1).reshape(-1)


def test_draft_equal_to_target_is_always_accepted():
    torch.manual_seed(5)
    k, n = 3, 2_000
    target = _rows(20, k, 1.0)
    logits = target.repeat(n, 1)
    p = probs_of(logits)
    sampled = _with_bonus(torch.multinomial(probs_of(target)[:k], n, replacement=True).T)  # d_j ~ q_j = p_j
    argmax = _with_bonus(target[:k].argmax(-1).repeat(n, 1))
    for greedy, d in ((False, sampled), (True, argmax)):
        _, acc = verify(logits, d, [k] * n, [greedy] * n, [None] * n, [0] * n, draft_probs=p)
        assert acc.double().mean().item() == k  # acceptance rate 1.0
    # a deterministic proposer whose draft the target is certain of: one-hot p == one-hot q
    sure = torch.full((k + 1, V), NEG_INF)
    sure[torch.arange(k + 1), torch.tensor([1, 5, 2, 0])] = 0.0
    tokens, acc = verify(sure, torch.tensor([1, 5, 2, -1]), [k], [False], [None], [0])
    assert acc.tolist() == [k] and tokens.tolist() == [1, 5, 2, 0]


# ---- seeded items -----------------------------------------------------------------------------------


def test_seeded_items_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(99)
    logits = torch.randn(3, V, generator=g)  # k = 2
    q = probs_of(torch.randn(3, V, generator=g))
    d = torch.tensor([2, 3, -1])
    alone_t, alone_a = verify(logits, d, [2], [False], [7], [5], q)
    torch.manual_seed(0)
    others = torch.randn(2 + 4 + 1, V)
    batch_logits = torch.cat([others[:2], logits, others[2:]])
    batch_q = torch.cat([probs_of(others[:2]), q, probs_of(others[2:])])
    batch_d = torch.tensor([0, -1, *d.tolist(), 1, 2, 3, -1, -1])
    ks, greedy, seeds, idx = [1, 2, 3, 0], [False, False, False, True], [None, 7, 123, None], [0, 5, 9, 2]
    for trial in range(3):  # the global RNG moves on; the seeded item must not
        torch.manual_seed(trial)
        t, a = verify(batch_logits, batch_d, ks, greedy, seeds, idx, batch_q)
        assert a[1].item() == alone_a.item()
        n = alone_a.item() + 1
        assert t[2 : 2 + n].tolist() == alone_t[:n].tolist()


def test_seeds_and_indices_change_the_draws():
    n, k = 400, 2
    logits = torch.zeros(n * (k + 1), V)  # uniform target: every draw is informative
    q_rows = probs_of(3 * torch.randn(k + 1, V, generator=torch.Generator().manual_seed(4)))
    q = q_rows.repeat(n, 1)
    d = _with_bonus(q_rows[:k].argmax(-1).repeat(n, 1))  # q(d) > 1/6: rejected now and then
    runs = {}
    for seed in (1, 2):
        t, a = verify(logits, d, [k] * n, [False] * n, [seed] * n, list(range(n)), q)
        runs[seed] = (t.tolist(), a.tolist())
    again = verify(logits, d, [k] * n, [False] * n, [1] * n, list(range(n)), q)
    assert (again[0].tolist(), again[1].tolist()) == runs[1]
    assert runs[1] != runs[2]
    assert len(set(runs[1][0][::3])) >= 3  # different draw indices draw different tokens


def test_a_seeded_draw_depends_on_its_output_index_alone():
    """The correction at row 1 of an item drawn at index m is the token a draftless item draws at m + 1."""
    g = torch.Generator().manual_seed(12)
    rows = torch.randn(3, V, generator=g)
    rows[0] = NEG_INF
    rows[0, 2] = 0.0  # row 0: the target is certain of draft 2
    rows[1, 5] = NEG_INF  # row 1: draft 5 cannot pass, and the residual is p_1 itself
    for seed, m in [(3, 0), (3, 7), (11, 2), (12, 40)]:
        tokens, acc = verify(rows, torch.tensor([2, 5, -1]), [2], [False], [seed], [m])
        assert acc.tolist() == [1] and tokens[0].item() == 2
        alone, _ = verify(rows[1:2], torch.tensor([-1]), [0], [False], [seed], [m + 1])
        assert tokens[1].item() == alone.item()


def test_no_drafts_draws_what_the_sampler_draws():
    vocab = 32
    sampler = Sampler(vocab)
    torch.manual_seed(8)
    raw = torch.randn(6, vocab)
    rows = [
        SamplingRow(SamplingParams(temperature=0.8, top_k=10, seed=s), [1, 2], [3] * m, frozenset())
        for s, m in [(1, 0), (2, 4), (3, 9), (40, 1), (5, 2), (6, 3)]
    ]
    want, _ = sampler.sample(raw, rows)
    x = sampler.filtered_logits(raw, rows)
    n = len(rows)
    seeds = [r.params.seed for r in rows]
    index = [len(r.output_token_ids) for r in rows]
    got, acc = verify(x, torch.full((n,), -1), [0] * n, [False] * n, seeds, index)
    assert acc.tolist() == [0] * n
    assert got.tolist() == want.tolist()


# ---- NgramIndex -------------------------------------------------------------------------------------


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if L < n + 1:
            continue
        for e in range(L - 1, n - 1, -1):
            if tokens[e - n : e] == tokens[L - n :]:
                return tokens[e : e + k]
    return []


def _index(tokens: list[int], min_n: int, max_n: int) -> NgramIndex:
    idx = NgramIndex(min_n, max_n)
    idx.extend(tokens)
    return idx


def test_ngram_proposes_the_most_recent_continuation():
    idx = _index([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 3, 3)
    assert len(idx) == 12
    assert idx.propose(2) == [7, 8]
    assert idx.propose(10) == [7, 8, 1, 2, 3]  # stops at the current end
    assert idx.propose(0) == []


def test_ngram_prefers_longer_matches():
    toks = [5, 6, 7, 6, 8, 5, 6]
    assert _index(toks, 1, 2).propose(1) == [7]  # (5, 6) matched at the start
    assert _index(toks, 1, 1).propose(1) == [8]  # (6,) most recently followed by 8


def test_ngram_end_of_sequence_and_no_match():
    assert _index([1, 2, 1, 2], 2, 2).propose(5) == [1, 2]
    assert _index([4, 4, 4], 1, 3).propose(3) == [4]  # (4, 4) last ended at 2: one token follows
    assert _index([1, 2, 3, 4], 1, 3).propose(3) == []
    assert _index([1], 1, 1).propose(3) == []
    assert _index([], 1, 3).propose(3) == []


def test_ngram_incremental_matches_brute_force():
    rng = random.Random(0)
    for min_n, max_n in [(1, 1), (1, 3), (2, 4)]:
        toks = [rng.randrange(4) for _ in range(300)]
        inc = NgramIndex(min_n, max_n)
        pos = 0
        while pos < len(toks):  # the prompt in one go, then outputs a few at a time
            step = 40 if pos == 0 else rng.randrange(1, 4)
            inc.extend(toks[pos : pos + step])
            pos = min(pos + step, len(toks))
            k = rng.randrange(0, 6)
            assert inc.propose(k) == _brute(toks[:pos], min_n, max_n, k), (min_n, max_n, pos, k)
        assert _index(toks, min_n, max_n).propose(5) == inc.propose(5)


def test_ngram_argument_validation():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)
    with pytest.raises(ValueError, match="max_n"):
        NgramIndex(3, 2)
    with pytest.raises(ValueError, match="k"):
        NgramIndex(1, 2).propose(-1)


# ---- CUDA -------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_follows_the_same_rules():
    dev = torch.device("cuda")
    torch.manual_seed(21)
    ks = [0, 2, 3, 1]
    logits = torch.randn(sum(ks) + len(ks), 40)
    top = logits.argmax(-1).tolist()
    starts = _layout(ks)
    drafts = [top[s : s + k] for k, s in zip(ks, starts)]
    drafts[2][1] = (drafts[2][1] + 1) % 40
    d = _drafts_row(drafts)
    n = len(ks)
    cpu = verify(logits, d, ks, [True] * n, [None] * n, [0] * n)
    gpu = verify(logits.to(dev), d.to(dev), ks, [True] * n, [None] * n, [0] * n)
    assert gpu[0].device.type == gpu[1].device.type == "cuda"
    assert gpu[1].tolist() == cpu[1].tolist() == [0, 2, 1, 1]
    assert gpu[0].tolist() == cpu[0].tolist()
    # sampled: the target distribution at every position, both RNG paths
    base = _rows(10, 3, 1.5)
    p = probs_of(base)
    q = probs_of(base + _rows(11, 3, 1.5))
    for seeded in (False, True):
        out, acc = _trials(base.to(dev), q.to(dev), None, seeded)
        out, acc = out.cpu(), acc.cpu()
        for j in range(4):
            _check_matches(out[:, 0] if j == 0 else out[acc >= j, j], p[j])
    # seeded draws do not depend on the batch, and a draftless item draws what the sampler draws
    sampler = Sampler(V)
    rows = [SamplingRow(SamplingParams(seed=s), [], [0] * s, frozenset()) for s in (4, 9, 2)]
    x = torch.randn(3, V, device=dev)
    want, _ = sampler.sample(x, rows)
    mixed = [None, 4, None, 9, 2]
    batch = torch.cat([x[:1], x[:1], x[1:2], x[1:]])
    got, _ = verify(batch, torch.full((5,), -1, device=dev), [0] * 5, [False] * 5, mixed, [0, 4, 0, 9, 2])
    assert got[[1, 3, 4]].tolist() == want.tolist()
