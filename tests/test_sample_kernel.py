"""The CUDA sampling kernel (foveal/sample/triton_sample.py) against the sampler's torch path.

Run on CPU tensors under Triton's interpreter (conftest sets TRITON_INTERPRET=1), and on CUDA where
there is one (the same assertions plus the Sampler end to end). The torch path sorts; the kernel
bisects on thresholds: the kept sets must be the same sets (logits here have no ties) and the tokens
the same tokens (both draw with the same counter-based noise, sample/noise.py).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from foveal.request import SamplingParams
from foveal.sample import noise
from foveal.sample.sampler import Sampler, SamplingRow
from foveal.sample.triton_sample import sample_rows, thresholds

# (temperature, min_p, top_k, top_p): every filter alone, together, and at their edges
MIXES = [
    (0.0, 0.0, 0, 1.0),
    (1.0, 0.0, 0, 1.0),
    (0.7, 0.0, 20, 1.0),
    (1.0, 0.0, 0, 0.9),
    (1.3, 0.05, 0, 1.0),
    (1.0, 0.0, 50, 0.5),
    (0.5, 0.05, 20, 0.9),
    (2.0, 0.0, 0, 0.5),
    (1.0, 0.0, 1, 1.0),
    (1.0, 0.0, 0, 0.01),
    (1.0, 0.5, 0, 1.0),
    (1.0, 0.0, 299, 0.99),
    (0.3, 0.0, 0, 0.999),
]


def _device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    return "cpu"


def _params(mix) -> SamplingParams:
    t, mp, k, p = mix
    return SamplingParams(temperature=t, min_p=mp, top_k=k, top_p=p)


# the kernel's tiles the tests take: its default; 16 columns a block (each a lane); 64 columns a block
# with 16 lanes apart (pass 1's candidates 16 columns a step, the other passes 64)
TILES = [None, 16, (64, 16)]


def _set_tile(monkeypatch, tile) -> None:
    from foveal.sample import triton_sample

    if tile is not None:
        block, lanes = tile if isinstance(tile, tuple) else (tile, 0)
        monkeypatch.setattr(triton_sample, "_BLOCK", block)
        monkeypatch.setattr(triton_sample, "_LANES", lanes)


def _columns(x: torch.Tensor, mixes) -> torch.Tensor:
    return torch.tensor([[m[i] for m in mixes] for i in range(4)], dtype=torch.float32, device=x.device)


def _draw(x: torch.Tensor, mixes, seeds, vocab: int) -> torch.Tensor:
    """The kernel's tokens for rows x of the mixes."""
    cols = _columns(x, mixes)
    keys = noise.key_halves(noise.row_keys(seeds, [0] * len(mixes)), x.device)
    return sample_rows(x, cols[0], cols[1], cols[2], cols[3], keys, vocab)


def _run(x: torch.Tensor, mixes, seeds, vocab: int):
    """(the kernel's tokens, its thresholds) for rows x of the mixes."""
    cols = _columns(x, mixes)
    return _draw(x, mixes, seeds, vocab), thresholds(x, cols[0], cols[1], cols[2], cols[3], vocab)


@pytest.mark.parametrize("block", TILES, ids=["default", "16", "64-lanes-16"])
@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_kept_sets_and_tokens_equal_the_torch_path(scale, block, monkeypatch):
    """At the default block every lane holds one column, so each draw races over the lanes' candidates
    in registers; at 16 columns a block the lanes are full and most races take passes over the row."""
    _set_tile(monkeypatch, block)
    dev = _device()
    V = 300
    g = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(len(MIXES), V, generator=g) * scale
    seeds = list(range(100, 100 + len(MIXES)))
    tokens, tau = _run(x.to(dev), MIXES, seeds, V)
    s = Sampler(V)
    for i, mix in enumerate(MIXES):
        if mix[0] == 0:
            assert tokens[i].item() == x[i].argmax().item()
            continue
        want = s.sort_filter(x[i : i + 1].clone(), [_params(mix)])[0]
        kept = torch.isfinite(want)
        mine = (x[i] / mix[0]) >= tau[i].cpu()
        assert torch.equal(kept, mine), (mix, kept.sum().item(), mine.sum().item())
        row = SamplingRow(SamplingParams(temperature=mix[0], seed=seeds[i]), [], [], frozenset())
        drawn = s._draw(want[None].softmax(-1), [row])
        assert tokens[i].item() == drawn.item(), mix


@pytest.mark.parametrize("block", TILES, ids=["default", "16", "64-lanes-16"])
def test_top_k_radix_select_with_ties_signs_and_zeros(block, monkeypatch):
    """top_k's k-th largest by radix select on the float keys: logits from a few values (ties across
    the k-th), negative and positive, +0.0 and -0.0 (equal as numbers), -inf masked columns; each k
    keeps what the sort keeps (every tie at the k-th value) and the tokens are the torch path's. At 16
    columns a block each lane sees 10 values, so both the lanes' candidates and the row's passes
    (k past the 64 candidates, or a lane hiding values above the candidates' k-th) find it."""
    _set_tile(monkeypatch, block)
    dev = _device()
    V = 160
    g = torch.Generator().manual_seed(21)
    x = (torch.randint(-6, 7, (10, V), generator=g) / 4.0).float()
    x[0, ::3] = -0.0
    x[1, :150] = float("-inf")  # 10 finite values left: k >= 10 keeps them all
    x[2] = x[2].abs().neg()  # all <= 0
    x[8:, 80:] = float("-inf")  # 80 finite values, 5 in each lane of 16: past the candidates, k 100 keeps all
    ks = [1, 7, 10, 12, 33, 64, 159, 5, 100, 70]
    mixes = [(0.9, 0.0, k, 1.0) if i % 2 else (1.0, 0.02, k, 1.0) for i, k in enumerate(ks)]
    tokens, tau = _run(x.to(dev), mixes, list(range(10)), V)
    s = Sampler(V)
    for i, mix in enumerate(mixes):
        want = s.sort_filter(x[i : i + 1].clone(), [_params(mix)])[0]
        kept = torch.isfinite(want)
        assert torch.equal(kept, (x[i] / mix[0]) >= tau[i].cpu()), (i, kept.sum().item())
        row = SamplingRow(SamplingParams(temperature=mix[0], seed=i), [], [], frozenset())
        assert tokens[i].item() == s._draw(want[None].softmax(-1), [row]).item(), mix


def test_top_k_when_one_lane_holds_the_largest_values(monkeypatch):
    """The lanes' 4 candidates miss a lane's 5th-largest value: the rows' largest values all in one lane
    (columns 3, 3 + 16, ...), so the candidates' k-th is wrong and the kernel must see it and select
    over the row; and rows where the largest values spread over the lanes (the candidates suffice)."""
    from foveal.sample import triton_sample

    monkeypatch.setattr(triton_sample, "_BLOCK", 16)
    dev = _device()
    V = 200
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, V, generator=g)
    x[:3, 3::16] += 10.0 + torch.rand(3, len(range(3, V, 16)), generator=g)  # 13 values in lane 3
    x[3:, :12] += 10.0 + torch.rand(3, 12, generator=g)  # 12 values in 12 lanes
    ks = [5, 9, 12, 5, 9, 12]
    mixes = [(1.0, 0.0, k, 1.0) for k in ks]
    tokens, tau = _run(x.to(dev), mixes, list(range(6)), V)
    s = Sampler(V)
    for i, mix in enumerate(mixes):
        want = s.sort_filter(x[i : i + 1].clone(), [_params(mix)])[0]
        kept = torch.isfinite(want)
        assert kept.sum().item() == ks[i] and torch.equal(kept, x[i] >= tau[i].cpu()), i
        row = SamplingRow(SamplingParams(temperature=1.0, seed=i), [], [], frozenset())
        assert tokens[i].item() == s._draw(want[None].softmax(-1), [row]).item(), mix


@pytest.mark.parametrize("block", TILES, ids=["default", "16", "64-lanes-16"])
def test_top_p_rounds_on_flat_rows(block, monkeypatch):
    """Near-flat rows with a small top_p: the winner of the first race is almost never in the kept set,
    so the draw takes several rounds, each on the set above the last winner: every token is in the
    kept set and is the one the torch path draws from it. At 16 columns a block the first rounds pass
    over the row and the last ones race over the lanes' candidates."""
    _set_tile(monkeypatch, block)
    dev = _device()
    V, n = 400, 12
    g = torch.Generator().manual_seed(8)
    x = torch.randn(n, V, generator=g) * 0.05
    mixes = [(1.0, 0.0, 0, (0.02, 0.1, 0.3)[i % 3]) for i in range(n)]
    tokens = _draw(x.to(dev), mixes, list(range(50, 50 + n)), V)  # (no thresholds: none are read)
    s = Sampler(V)
    for i, mix in enumerate(mixes):
        want = s.sort_filter(x[i : i + 1].clone(), [_params(mix)])[0]
        assert torch.isfinite(want[tokens[i]]), mix
        row = SamplingRow(SamplingParams(temperature=1.0, seed=50 + i), [], [], frozenset())
        assert tokens[i].item() == s._draw(want[None].softmax(-1), [row]).item(), mix


def test_penalties_in_one_pass_equal_the_torch_ops():
    """triton_sample.penalize (CUDA's penalties: the device history read and applied in place, one
    pass) against the Sampler's torch ops on the same history: rows in any order, slots shared by none,
    repetition below and above 1, negative presence, rows with no count at all."""
    from foveal.sample.triton_sample import penalize

    dev = _device()
    V = 3000  # two column blocks
    s = Sampler(V, "cpu")
    g = torch.Generator().manual_seed(3)
    params = [
        SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(temperature=0.0, repetition_penalty=0.7, presence_penalty=-0.5),
        SamplingParams(temperature=0.5, presence_penalty=0.8, frequency_penalty=0.1),
        SamplingParams(temperature=1.0, repetition_penalty=1.5),
    ]
    rows = []
    for i, p in enumerate(params):
        prompt = torch.randint(0, V, (40,), generator=g).tolist()
        out = torch.randint(0, V, (25,), generator=g).tolist() + [2999, 2999]
        s.history.start(7 - i, prompt, out if i != 3 else [], p.repetition_penalty != 1.0)
        rows.append(SamplingRow(p, prompt, out, frozenset(), None, 7 - i))
    x = torch.randn(6, V, generator=g) * 3
    pen = [4, 0, 5, 2]  # the logits rows of the four penalized rows
    want = x.clone()
    s._apply_penalties(want, [rows[pen.index(i)] if i in pen else None for i in range(6)], pen)
    got = x.clone().to(dev)
    vals = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params])
    at = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    penalize(got, at(pen), at([r.slot for r in rows]), vals.to(dev), s.history.counts.to(dev),
             s.history.prompt.to(dev))  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    assert not torch.equal(want[pen], x[pen]) and torch.equal(got.cpu()[[1, 3]], x[[1, 3]])


_PENALIZED: dict = {}


def _penalized_rows(dev: str):
    """The penalties test's rows, history and references, made once a device at the kernel's default
    tiles (the tokens are the tiles' own: each tile's draws equal the torch path's, above): (x, slots,
    vals, counts, prompt, the columns, the keys, the draws from penalize()'s float32 copy, the draws
    with no penalties)."""
    from foveal.sample.triton_sample import penalize

    if dev in _PENALIZED:
        return _PENALIZED[dev]
    V, W = 600, 640
    g = torch.Generator().manual_seed(21)
    hist = Sampler(V, "cpu").history
    for slot in range(5):
        prompt = torch.randint(0, V, (60,), generator=g).tolist()
        out = torch.randint(0, 40, (30,), generator=g).tolist()  # the likely tokens, counted often
        hist.start(slot, prompt, out, True)
    n = len(MIXES)
    x = (torch.randn(n, W, generator=g) * 2).to(torch.bfloat16)
    x[:, :40] += 3.0  # the counted tokens lead: the penalties change the draws
    slots = [i % 6 - 1 if i != 4 else 2 for i in range(n)]  # -1: no penalties; rows 3 and 4 share slot 2
    vals = torch.tensor([[1.0 + 0.1 * (i % 4), 0.3 * (i % 3), 0.5 - 0.2 * (i % 2)] for i in range(n)])
    at = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    pen = [i for i in range(n) if slots[i] >= 0]
    want_x = x[:, :V].float().to(dev)
    counts, prompt = hist.counts.to(dev), hist.prompt.to(dev)
    penalize(want_x, at(pen), at([slots[i] for i in pen]), vals[pen].to(dev), counts, prompt)
    cols = torch.tensor([[m[i] for m in MIXES] for i in range(4)], dtype=torch.float32, device=dev)
    keys = noise.key_halves(noise.row_keys(list(range(n)), [0] * n), dev)
    want = sample_rows(want_x, cols[0], cols[1], cols[2], cols[3], keys, V).tolist()
    plain = sample_rows(x[:, :V].float().to(dev), cols[0], cols[1], cols[2], cols[3], keys, V).tolist()
    _PENALIZED[dev] = (x, slots, vals, counts, prompt, cols, keys, want, plain)
    return _PENALIZED[dev]


@pytest.mark.parametrize("block", TILES, ids=["default", "16", "64-lanes-16"])
def test_penalties_read_as_the_rows_load_equal_the_penalized_copy(block, monkeypatch):
    """sample_rows with `penalties` (the raw bf16 rows read once, the device history applied as they
    load) draws what it draws from penalize()'s float32 copy: every mix, greedy rows included, rows with
    and without a slot, two rows on one slot; block 16 takes the radix select and the top_p rounds
    through the penalized loads too. The references (the copy's draws, the draws with no penalties) are
    the default tiles' for every tile, made once."""
    from foveal.sample.triton_sample import row_order

    dev = _device()
    V = 600
    x, slots, vals, counts, prompt, cols, keys, want, plain = _penalized_rows(dev)  # before the tile
    _set_tile(monkeypatch, block)
    at = lambda v: torch.tensor(v, dtype=torch.long, device=dev)  # noqa: E731
    slot_t = at(slots) if block is None else at(slots).float()  # the Sampler packs them as float32
    got = sample_rows(x.to(dev), cols[0], cols[1], cols[2], cols[3], keys, V,
                      penalties=(slot_t, vals.T.contiguous().to(dev), counts, prompt))  # fmt: skip
    assert got.tolist() == want
    assert plain != want  # the penalties changed some draws: the test can fail
    # the heavy rows' programs first (the Sampler's order): each row reads and writes its own
    heavy = row_order(*cols.tolist())
    assert heavy is not None and heavy != sorted(heavy)
    ordered = sample_rows(x.to(dev), cols[0], cols[1], cols[2], cols[3], keys, V,
                          penalties=(slot_t, vals.T.contiguous().to(dev), counts, prompt),
                          order=torch.tensor(heavy, dtype=torch.float32, device=dev))  # fmt: skip
    assert ordered.tolist() == want


@pytest.mark.parametrize("lanes", [None, 16], ids=["default", "16-lanes"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_logprobs_equal_logsumexp_and_the_chosen_logit(dtype, lanes, monkeypatch):
    """triton_sample.row_logprobs (CUDA's logprobs: one pass over each asked row, in parts) against
    torch's logsumexp, gather and topk on a float copy: a subset of rows in any order, columns past the
    vocabulary in the rows' stride (the view the Sampler passes), -inf entries, a row wide in scale, a
    row whose largest values crowd one lane, one whose largest tie across lanes; the top ones for k up
    to TOP_SLOTS, none past it. The default lanes make 3 parts of a row (13 empty), 16 lanes 14 parts
    (the crowded lane's values and the ties in parts of their own, merged)."""
    from foveal.sample import triton_sample
    from foveal.sample.triton_sample import TOP_SLOTS, row_logprobs

    if lanes is not None:
        monkeypatch.setattr(triton_sample, "_TOP_LANES", lanes)
        monkeypatch.setattr(triton_sample, "_LSE_LANES", lanes)
    dev = _device()
    V, W = 1100, 1152  # past the 512 lanes of the top-k pass: each lane sees two or three values
    g = torch.Generator().manual_seed(17)
    x = torch.randn(6, W, generator=g) * torch.tensor([1, 3, 30, 1, 0.1, 5])[:, None]
    x[1, ::3] = float("-inf")  # a grammar-masked row
    x[3, 7::512] += torch.tensor([60.0, 55.0, 50.0])  # row 3's three largest in one lane, falling
    x[5, [600, 10, 530, 20, 1000]] = 40.0  # row 5's largest tie across lanes: the smaller columns first
    x = x.to(dtype)
    x[:, V:] = 100.0  # padding: never counted
    tokens = torch.randint(0, V, (6,), generator=g)
    tokens[1] = 1  # a live token of the masked row
    rows = torch.tensor([4, 1, 2, 0, 3, 5])
    sub = x[rows, :V].float()
    lse = torch.logsumexp(sub, dim=-1)
    chosen = sub.gather(1, tokens[rows, None])[:, 0] - lse
    for k in (0, 3, TOP_SLOTS, TOP_SLOTS + 1):
        both, pack = row_logprobs(x.to(dev)[:, :V], rows.to(dev), tokens.to(dev), k)
        both = both.cpu()
        torch.testing.assert_close(both[:, 0], lse, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(both[:, 1], chosen, rtol=1e-6, atol=1e-5)
        if not 0 < k <= TOP_SLOTS:
            assert pack is None
            continue
        pack = pack.cpu()
        top_v, top_i = sub.topk(k, dim=-1)
        assert pack[:, 0].tolist() == tokens[rows].double().tolist()
        torch.testing.assert_close(pack[:, 1], chosen.double(), rtol=1e-6, atol=1e-5)
        assert pack[-1, 2 + k :].long().tolist() == [10, 20, 530, 600, 1000, *top_i[-1, 5:].tolist()][:k]
        if dtype == torch.float32:  # bf16's ties leave the order among equal values open (torch's too)
            assert pack[:-1, 2 + k :].long().tolist() == top_i[:-1].tolist()
        torch.testing.assert_close(pack[:, 2 : 2 + k], (top_v - lse[:, None]).double(), rtol=1e-6, atol=1e-5)


def test_bf16_logits_padded_columns_and_masked_rows():
    """bf16 rows wider than the vocabulary (an LM head's padding is never drawn), a row with all but
    three tokens at -inf (a grammar's mask) whose top_k is larger than what is left, ties at the top."""
    dev = _device()
    V, W = 200, 256
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(4, W, generator=g) * 2).to(torch.bfloat16)
    x[:, V:] = 50.0  # padding columns: would win every draw if read
    x[1, :V] = float("-inf")
    x[1, [7, 70, 170]] = torch.tensor([1.0, 0.5, 0.25], dtype=torch.bfloat16)
    x[2, :V] = 0.0  # all tied: top_k keeps them all, every token possible
    mixes = [(1.0, 0.0, 0, 0.9), (1.0, 0.0, 40, 1.0), (1.0, 0.0, 10, 0.5), (0.0, 0.0, 0, 1.0)]
    tokens, _ = _run(x.to(dev), mixes, [1, 2, 3, 4], V)
    tokens = tokens.tolist()
    assert all(t < V for t in tokens)
    assert tokens[1] in (7, 70, 170)
    assert tokens[3] == x[3, :V].float().argmax().item()


def test_draws_follow_the_filtered_distribution():
    """Many unseeded rows of one distribution: the frequencies of the kernel's tokens against the
    filtered softmax (chi-square, df = kept - 1)."""
    dev = _device()
    torch.manual_seed(11)
    V, n = 12, 300  # the interpreter runs ~40 programs a second
    logits = torch.linspace(-1.0, 1.5, V)
    mix = (1.2, 0.0, 8, 0.95)
    tokens = _draw(logits.repeat(n, 1).to(dev), [mix] * n, [None] * n, V)  # no thresholds: half the time
    probs = Sampler(V).filter(logits[None].clone(), [_params(mix)]).softmax(-1)[0]
    counts = torch.bincount(tokens.cpu(), minlength=V).tolist()
    kept = [t for t in range(V) if probs[t] > 0]
    assert all(counts[t] == 0 for t in range(V) if t not in kept)
    chi = sum((counts[t] - n * probs[t].item()) ** 2 / (n * probs[t].item()) for t in kept)
    assert chi < 30, chi  # df = 7: P(chi2 > 30) ~ 1e-4; the keys are fixed by the seed above


def test_seeded_rows_draw_the_same_token_in_any_batch():
    dev = _device()
    V = 100
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, V, generator=g)
    mixes = [(1.0, 0.0, 0, 0.9)] * 6
    seeds = [7, None, 8, None, 9, 10]
    full, _ = _run(x.to(dev), mixes, seeds, V)
    for i in (0, 2, 4, 5):
        alone, _ = _run(x[i : i + 1].to(dev), mixes[:1], seeds[i : i + 1], V)
        assert alone.item() == full[i].item()


def test_the_samplers_packing_and_row_order_draw_what_the_cpu_sampler_draws():
    """Sampler._draw_kernel (CUDA's draw: the rows' columns and the heavy-first order packed into one
    host copy, then the kernel) on CPU tensors in the interpreter, against the CPU Sampler's sort-based
    draw of the same seeded rows."""
    from foveal.sample import triton_sample

    if _device() != "cpu":
        pytest.skip("CUDA runs the Sampler end to end (below)")
    V = 300
    x = torch.randn(len(MIXES), V, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=t, min_p=mp, top_k=k, top_p=p, seed=i) for i, (t, mp, k, p) in
              enumerate(MIXES)]  # fmt: skip
    assert triton_sample.row_order(*[[m[i] for m in MIXES] for i in range(4)]) is not None
    assert triton_sample.row_order([0.7, 0.6], [0.0] * 2, [0] * 2, [1.0] * 2) is None  # alike: any order
    rows = [SamplingRow(p, [], [], frozenset()) for p in params]
    s = Sampler(V, "cpu")
    cpu, _ = s.sample(x.clone(), rows)
    assert s._draw_kernel(x.clone(), rows).tolist() == cpu.tolist()
    # with penalties read from the device history: each row's slot and its three penalties packed too
    g = torch.Generator().manual_seed(5)
    rows = []
    for i, p in enumerate(params):
        if i % 2:
            pen = dict(repetition_penalty=1.5, frequency_penalty=0.5 * (i % 3), presence_penalty=1.0)
            p = dataclasses.replace(p, **pen)
        prompt, out = (torch.randint(0, V, (n,), generator=g).tolist() for n in (40, 20))
        slot = 10 + i if p.needs_penalties else None
        if slot is not None:
            s.history.start(slot, prompt, out, True)
        rows.append(SamplingRow(p, prompt, out, frozenset(), None, slot))
    cpu, _ = s.sample(x.clone(), rows)
    assert s._draw_kernel(x.clone(), rows, penalties=True).tolist() == cpu.tolist()
    plain = s._draw_kernel(x.clone(), rows)  # the same rows, their penalties not applied
    assert plain.tolist() != cpu.tolist()  # the penalties changed some draws: the check can fail


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("penalized", [True, False])
def test_cuda_sampler_draws_what_the_cpu_sampler_draws(penalized):
    """The Sampler end to end: processing (penalties) then the kernel on CUDA, the sort-based filters
    on the CPU: seeded rows give the same tokens (near-ties of float rounding aside: none here). Without
    penalties the kernel reads the raw rows: bf16 logits wider than the vocabulary (an LM head's
    padding), no float32 copy."""
    V = 500
    g = torch.Generator().manual_seed(9)
    x = torch.randn(len(MIXES), V, generator=g) * 2
    if not penalized:
        x = torch.cat([x, torch.full((len(MIXES), 12), 40.0)], dim=1).to(torch.bfloat16)
    pen = dict(repetition_penalty=1.2, presence_penalty=0.3) if penalized else {}
    rows = [
        SamplingRow(
            SamplingParams(temperature=t, min_p=mp, top_k=k, top_p=p, seed=i, **pen),  # fmt: skip
            [1, 2, 3],
            [4, 5, 5],
            frozenset(),
        )
        for i, (t, mp, k, p) in enumerate(MIXES)
    ]
    s = Sampler(V)
    cpu, _ = s.sample(x, rows)
    gpu, _ = s.sample(x.cuda(), rows)
    from foveal.sample import sampler

    assert sampler._kernel_ok.get("sample") is True  # the kernel drew them, not the torch ops' fallback
    assert gpu.cpu().tolist() == cpu.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_applies_history_penalties_in_the_kernel(monkeypatch):
    """Rows whose penalties read the device history: the CUDA Sampler draws from the raw bf16 logits with
    the kernel applying the penalties (no penalize() pass, no float32 copy) and gets the CPU Sampler's
    tokens on the same histories; a row with a logit bias sends the batch the processed way, same tokens."""
    from foveal.sample import triton_sample

    V = 500
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(len(MIXES), V + 12, generator=g) * 2).to(torch.bfloat16)
    x[:, :20] += 2.0  # the prompt's and outputs' tokens lead: the penalties change draws
    cpu_s, gpu_s = Sampler(V, "cpu"), Sampler(V, "cuda")
    rows = []
    for i, (t, mp, k, p) in enumerate(MIXES):
        pen = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2) if i % 3 else {}
        params = SamplingParams(temperature=t, min_p=mp, top_k=k, top_p=p, seed=i, **pen)
        prompt, out = [1, 2, 3, i], [4, 5, 5, 6 + i % 5]
        slot = i if pen else None
        if pen:
            cpu_s.history.start(slot, prompt, out, True)
            gpu_s.history.start(slot, prompt, out, True)
        rows.append(SamplingRow(params, prompt, out, frozenset(), None, slot))
    calls = []
    monkeypatch.setattr(triton_sample, "penalize", lambda *a: calls.append(a) or a[0])
    cpu, _ = cpu_s.sample(x.float(), rows)
    gpu, _ = gpu_s.sample(x.cuda(), rows)
    assert gpu.cpu().tolist() == cpu.tolist() and not calls
    monkeypatch.undo()
    bare = [
        SamplingParams(temperature=t, min_p=mp, top_k=k, top_p=p, seed=i)
        for i, (t, mp, k, p) in enumerate(MIXES)
    ]
    plain, _ = gpu_s.sample(x.cuda(), [SamplingRow(b, [1], [], frozenset()) for b in bare])
    assert plain.cpu().tolist() != cpu.tolist()  # the penalties changed some draws
    biased = SamplingParams(temperature=1.0, seed=99, logit_bias={7: 0.5})
    rows[0] = SamplingRow(biased, [1], [], frozenset())
    cpu, _ = cpu_s.sample(x.float(), rows)
    gpu, _ = gpu_s.sample(x.cuda(), rows)
    assert gpu.cpu().tolist() == cpu.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logprobs_equal_the_cpu_samplers():
    """The Sampler's logprobs on CUDA (row_logprobs' one pass, then torch.topk) against the CPU's torch
    ops: rows wider than the vocabulary, greedy and sampled rows, top-k of 0, 3 and 20, rows that ask
    none (float32 logits: bf16's ties would let the two topk orders differ)."""
    V = 300
    g = torch.Generator().manual_seed(23)
    x = torch.randn(6, V + 20, generator=g) * 3
    x[:, V:] = 60.0
    asks = [None, 0, 3, 20, 3, None]
    rows = [
        SamplingRow(SamplingParams(temperature=0.8 * (i % 2), seed=i, logprobs=k), [1], [], frozenset())
        for i, k in enumerate(asks)
    ]
    s = Sampler(V)
    cpu_t, cpu_lp = s.sample(x, rows)
    gpu_t, gpu_lp = s.sample(x.cuda(), rows)
    assert gpu_t.cpu().tolist() == cpu_t.tolist()
    for a, b, k in zip(cpu_lp.values(), gpu_lp.values(), asks):
        assert (a is None) == (b is None) == (k is None)
        if a is not None:
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top] and len(b.top) == k
            assert all(abs(p.logprob - q.logprob) < 1e-4 for p, q in zip(a.top, b.top))


def test_row_keys_are_draw_seed_of_each_row_and_the_generators_draws():
    """row_keys computes draw_seed on arrays (numpy's wrapping uint64): equal to it row by row for seeds
    of any size and sign, with a salt; the unseeded rows take the global generator's one draw, in order
    (torch.manual_seed still fixes a run)."""
    seeds = [0, 1, -7, 2**64 + 5, None, 2**80 - 3, None, 12345]
    indices = [0, 3, 9, 100000, 4, 2**31, 1, 17]
    for salt in (0, 0x5EED):
        torch.manual_seed(3)
        keys = noise.row_keys(seeds, indices, salt)
        torch.manual_seed(3)
        drawn = iter(torch.randint(0, 1 << 62, (2,)).tolist())
        want = [next(drawn) if s is None else noise.draw_seed(s ^ salt, i) for s, i in zip(seeds, indices)]
        assert keys.tolist() == want
        assert all(0 <= k < 2**63 for k in want)
    assert noise.row_keys([], []).tolist() == []


def test_noise_is_the_same_bits_by_every_implementation():
    """The C fill (the CPU's) and the torch integer ops (CUDA's rejection sampler, any device without
    a compiler) give bit-identical uniforms; their exponentials agree to float rounding; a row's noise
    depends on its key alone."""
    from foveal.sample.noise import _cpu_kernel, key_halves, row_keys, uniforms

    if _cpu_kernel() is None:
        pytest.skip("no C compiler here")
    keys = key_halves(row_keys([1, 2, None, 2**40], [0, 7, 0, 3]), "cpu")
    V = 5000
    by_torch = uniforms(keys, torch.arange(V))
    assert torch.equal(noise.uniform_matrix(keys, V), by_torch)
    torch.testing.assert_close(noise.exponentials(keys, V), -torch.log(by_torch), rtol=1e-6, atol=0)
    assert torch.equal(noise.uniform_matrix(keys[1:2], V)[0], by_torch[1])
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":  # CUDA's one launch
        from foveal.sample.triton_sample import fill_noise

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        assert torch.equal(fill_noise(keys.to(dev), V, uniform=True).cpu(), by_torch)
        exp = fill_noise(keys.to(dev), V, uniform=False).cpu()
        torch.testing.assert_close(exp, -torch.log(by_torch), rtol=1e-6, atol=0)
    assert 0 < by_torch.min() and by_torch.max() < 1 and abs(by_torch.mean().item() - 0.5) < 0.01


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_filter_keeps_what_the_sort_keeps():
    """filter() on CUDA (the kernel's thresholds) against the CPU's sort: the same kept sets, the same
    tempered values on them (speculation's verify and the diffusion sampler read these)."""
    V = 700
    g = torch.Generator().manual_seed(12)
    x = torch.randn(len(MIXES) - 1, V, generator=g) * 2
    params = [_params(m) for m in MIXES[1:]]  # filter() takes sampled rows only
    s = Sampler(V)
    cpu = s.filter(x.clone(), params)
    gpu = s.filter(x.cuda(), params).cpu()
    assert torch.equal(torch.isfinite(cpu), torch.isfinite(gpu))
    kept = torch.isfinite(cpu)
    torch.testing.assert_close(gpu[kept], cpu[kept], rtol=1e-6, atol=1e-6)
