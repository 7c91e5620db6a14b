"""Sanity checks of the reference samplers themselves (tests/diffusion_reference.py) on tiny random
LLaDA / SDAR checkpoints: the transfer schedule, what every forward sees (recorded), blocks that end
unmasked, prompts never overwritten, the threshold rule's extremes, stop ids, the uniforms contract."""

from __future__ import annotations

import pytest
import torch

from tests.diffusion_models import MASK_ID, VOCAB, hf_model, write_llada, write_sdar
from tests.diffusion_reference import (
    block_causal_mask,
    block_generate,
    llada_generate,
    most_confident,
    num_transfer_tokens,
)


class Recorder:
    """Wraps a transformers model: records each forward's ids and 4-D mask."""

    def __init__(self, hf):
        self.hf, self.calls = hf, []

    def __call__(self, *, input_ids, attention_mask, position_ids):
        self.calls.append((input_ids[0].tolist(), attention_mask[0, 0] == 0))
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return hf_model(write_llada(tmp_path_factory.mktemp("llada"), seed=11))


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return hf_model(write_sdar(tmp_path_factory.mktemp("sdar"), seed=12, block_size=4))


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, MASK_ID, (n,), generator=g).tolist()


def _uniforms(seed: int, log: list | None = None):
    def u(step: int, shape: tuple[int, int]) -> torch.Tensor:
        if log is not None:
            log.append((step, shape))
        g = torch.Generator().manual_seed(seed * 1000 + step)
        return torch.rand(shape, dtype=torch.float64, generator=g)

    return u


def _masks(ids, lo, hi) -> int:
    return sum(t == MASK_ID for t in ids[lo:hi])


def test_schedule_and_ties():
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert num_transfer_tokens(8, 4) == [2, 2, 2, 2]
    assert num_transfer_tokens(3, 4) == [1, 1, 1, 0]
    assert num_transfer_tokens(0, 2) == [0, 0]
    assert most_confident([0, 1, 2, 3], [0.5, 0.9, 0.5, 0.9], 3) == [1, 3, 0]
    assert block_causal_mask(6, 4).int().tolist() == [[1, 1, 1, 1, 0, 0]] * 4 + [[1] * 6] * 2


# -- LLaDA ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("steps, gen, block", [(8, 16, 8), (8, 16, 16), (12, 12, 4)])
def test_llada_follows_the_schedule_block_by_block(llada, steps, gen, block):
    rec, prompt = Recorder(llada), _prompt(5, seed=1)
    out = llada_generate(rec, prompt, steps=steps, gen_length=gen, block_length=block, mask_id=MASK_ID)
    p, nb = len(prompt), gen // block
    spb = steps // nb
    assert len(out) == gen and MASK_ID not in out
    assert len(rec.calls) == steps  # every scheduled step runs a forward
    for f, (ids, allowed) in enumerate(rec.calls):
        b, i = divmod(f, spb)
        lo, hi = p + b * block, p + (b + 1) * block
        assert ids[:p] == prompt and allowed.all()  # the prompt is kept; attention is bidirectional
        assert _masks(ids, p, lo) == 0 and _masks(ids, hi, p + gen) == p + gen - hi  # blocks in order
        assert _masks(ids, lo, hi) == block - sum(num_transfer_tokens(block, spb)[:i])
        if f:  # tokens never change once chosen
            prev = rec.calls[f - 1][0]
            assert all(t == q for t, q in zip(ids, prev) if q != MASK_ID)


def test_llada_one_block_half_steps(llada):
    """LLaDA's block_length == gen_length, steps == gen_length / 2: two tokens per step."""
    rec = Recorder(llada)
    out = llada_generate(rec, _prompt(7, seed=2), steps=8, gen_length=16, block_length=16, mask_id=MASK_ID)
    assert MASK_ID not in out and len(rec.calls) == 8
    assert [_masks(ids, 7, 23) for ids, _ in rec.calls] == [16, 14, 12, 10, 8, 6, 4, 2]


def test_llada_sampling_uses_the_uniforms_contract(llada):
    prompt, kw = _prompt(4, seed=3), dict(steps=6, gen_length=12, block_length=4, mask_id=MASK_ID)
    log = []
    a = llada_generate(llada, prompt, temperature=0.7, uniforms=_uniforms(1, log), **kw)
    assert log == [(i, (12, VOCAB)) for i in range(6)]
    assert llada_generate(llada, prompt, temperature=0.7, uniforms=_uniforms(1), **kw) == a
    greedy = llada_generate(llada, prompt, **kw)
    samples = {
        tuple(llada_generate(llada, prompt, temperature=5.0, uniforms=_uniforms(s), **kw)) for s in range(3)
    }
    assert len(samples) > 1 and MASK_ID not in a and tuple(greedy) not in samples


def test_llada_refuses_bad_arguments(llada):
    with pytest.raises(ValueError, match="mask token"):
        llada_generate(llada, [5, MASK_ID], steps=4, gen_length=4, block_length=4, mask_id=MASK_ID)
    with pytest.raises(ValueError, match="multiple of block_length"):
        llada_generate(llada, [5], steps=4, gen_length=6, block_length=4, mask_id=MASK_ID)
    with pytest.raises(ValueError, match="number of blocks"):
        llada_generate(llada, [5], steps=3, gen_length=8, block_length=4, mask_id=MASK_ID)


# -- block diffusion --------------------------------------------------------------------------------
def _blocks_of(rec, p: int, bs: int):
    """Per forward: (block start, the block's ids) from the recorded sequences."""
    out = []
    for ids, allowed in rec.calls:
        end = len(ids)
        assert end % bs == 0 and torch.equal(allowed, block_causal_mask(end, bs))
        out.append((end - bs, ids[end - bs :]))
    return out


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic", "threshold"])
@pytest.mark.parametrize("plen", [6, 8])
def test_block_generate_keeps_the_prompt_and_finishes_every_block(sdar, strategy, plen):
    rec, prompt, bs = Recorder(sdar), _prompt(plen, seed=plen), 4
    out = block_generate(
        rec, prompt, block_size=bs, gen_length=10, mask_id=MASK_ID, steps_per_block=2, strategy=strategy,
        threshold=0.5,
    )  # fmt: skip
    first = plen // bs * bs
    generated = bs - plen % bs
    blocks = 1 + -(-(10 - generated) // bs)
    assert len(out) == 10 and MASK_ID not in out
    seen = _blocks_of(rec, plen, bs)
    assert [s for s, _ in seen] == sorted(s for s, _ in seen) and {s for s, _ in seen} == {
        first + k * bs for k in range(blocks)
    }
    for (start, blk), (ids, _) in zip(seen, rec.calls):
        assert ids[:plen] == prompt  # the prompt's tail in the first block is never overwritten
        assert MASK_ID not in ids[:start]  # committed blocks are complete
        assert MASK_ID in blk  # no forward for a finished block
        if start == first and plen % bs:
            assert blk[: plen % bs] == prompt[first:]
        if strategy != "threshold":
            assert sum(1 for s, _ in seen if s == start) <= 2  # within steps_per_block forwards
    final = rec.calls[-1][0]
    assert len(final) == first + blocks * bs


def test_static_schedule_counts(sdar):
    """Static: per block exactly ntt[s] tokens per forward; the first block's schedule splits its masks
    (bs - P % bs), not bs."""
    rec, bs = Recorder(sdar), 4
    block_generate(rec, _prompt(5), block_size=bs, gen_length=7, mask_id=MASK_ID, steps_per_block=2,
                   strategy="low_confidence_static")  # fmt: skip
    masks = [_masks(blk, 0, bs) for _, blk in _blocks_of(rec, 5, bs)]
    assert masks == [3, 1, 4, 2]  # first block: 3 masks -> [2, 1]; then 4 -> [2, 2]


def test_threshold_one_unmasks_one_token_per_forward(sdar):
    rec, bs = Recorder(sdar), 4
    out = block_generate(rec, _prompt(6), block_size=bs, gen_length=10, mask_id=MASK_ID, steps_per_block=None,
                         strategy="threshold", threshold=1.0)  # fmt: skip
    masks = [_masks(blk, 0, bs) for _, blk in _blocks_of(rec, 6, bs)]
    assert masks == [2, 1, 4, 3, 2, 1, 4, 3, 2, 1] and len(out) == 10


def test_threshold_zero_and_dynamic_extremes(sdar):
    """threshold 0: every mask passes, one forward per block (threshold and dynamic alike); dynamic with
    threshold 1.0 never passes and equals static."""
    prompt, bs, kw = _prompt(4, seed=9), 4, dict(block_size=4, gen_length=12, mask_id=MASK_ID)
    for strategy in ("threshold", "low_confidence_dynamic"):
        rec = Recorder(sdar)
        zero = block_generate(rec, prompt, steps_per_block=4, strategy=strategy, threshold=0.0, **kw)
        assert len(rec.calls) == 3 and MASK_ID not in zero
    rec_static, rec_dyn = Recorder(sdar), Recorder(sdar)
    static = block_generate(rec_static, prompt, steps_per_block=4, strategy="low_confidence_static", **kw)
    dyn = block_generate(
        rec_dyn, prompt, steps_per_block=4, strategy="low_confidence_dynamic", threshold=1.0, **kw
    )
    assert static == dyn and len(rec_static.calls) == len(rec_dyn.calls) == 12
    assert [_masks(blk, 0, bs) for _, blk in _blocks_of(rec_static, 4, bs)] == [4, 3, 2, 1] * 3


def test_stop_ids_end_generation_after_their_block(sdar):
    prompt, bs = _prompt(6, seed=4), 4
    kw = dict(
        block_size=bs, gen_length=30, mask_id=MASK_ID, steps_per_block=4, strategy="low_confidence_static"
    )
    full = block_generate(sdar, prompt, **kw)
    stop = full[9]  # a token generated in the third block (generated positions 6..9)
    first = full.index(stop)
    rec = Recorder(sdar)
    out = block_generate(rec, prompt, stop_ids=(stop,), **kw)
    assert out == full[: first + 1]
    tail = bs - len(prompt) % bs  # the first block's generated tokens
    blocks_run = 1 if first < tail else 2 + (first - tail) // bs
    assert len({len(ids) for ids, _ in rec.calls}) == blocks_run


def test_block_sampling_uses_the_uniforms_contract(sdar):
    prompt, log = _prompt(5, seed=5), []
    kw = dict(
        block_size=4, gen_length=7, mask_id=MASK_ID, steps_per_block=None, strategy="threshold", threshold=0.9
    )
    rec = Recorder(sdar)
    a = block_generate(rec, prompt, temperature=0.8, uniforms=_uniforms(2, log), **kw)
    assert log == [(i, (4, VOCAB)) for i in range(len(rec.calls))]
    assert block_generate(sdar, prompt, temperature=0.8, uniforms=_uniforms(2), **kw) == a
    samples = {
        tuple(block_generate(sdar, prompt, temperature=5.0, uniforms=_uniforms(s), **kw)) for s in range(3)
    }
    assert len(samples) > 1


def test_block_generate_refuses_bad_arguments(sdar):
    kw = dict(block_size=4, gen_length=4, mask_id=MASK_ID)
    with pytest.raises(ValueError, match="mask token"):
        block_generate(sdar, [MASK_ID], steps_per_block=2, strategy="threshold", **kw)
    with pytest.raises(ValueError, match="needs steps_per_block"):
        block_generate(sdar, [5], steps_per_block=None, strategy="low_confidence_static", **kw)
    with pytest.raises(ValueError, match="unknown strategy"):
        block_generate(sdar, [5], steps_per_block=2, strategy="entropy", **kw)
