"""KV-cache quantization (`kv_cache_dtype` fp8 / int8): quantize/dequantize error bounds, the torch
backend on a quantized pool against the plain backend (decode rows, chunked prefill, fresh prompts,
windows, spans, softcap), and on the real embedded model: teacher-forced top-1 agreement with the
unquantized cache, ~2x pool capacity for the same bytes, and prefix caching over quantized blocks."""

from __future__ import annotations

import pytest
import torch

from foveal.attention.kv_quant import (
    SCALE_DTYPES,
    QuantizedKVCache,
    bytes_per_token,
    dequantize,
    num_groups,
    quantize,
)
from foveal.attention.torch_backend import TorchAttentionBackend
from foveal.config import EngineConfig
from foveal.request import Request, RequestStatus, SamplingParams
from tests.test_attention_masks import HD, MIXED, NUM_KV, SCALE, SPANS, Case

KINDS = ["fp8", "int8"]


def round_trip(x: torch.Tensor, kind: str, groups: int = 1) -> torch.Tensor:
    return dequantize(*quantize(x, kind, groups), x.dtype)


# -- (1) quantize / dequantize ------------------------------------------------------------------------
# Bounds per group of one token and head: int8 rounds to a step of scale = amax/127 (times at most
# 1 + 2^-8 from the bf16 scale), so |error| <= amax/254 * 1.004; e4m3 keeps 3 mantissa bits, so
# |error| <= |x|/16 (plus the subnormal step near zero). Relative RMS error per row of 64 channels with
# one outlier channel: int8 0.8% with its two 32-channel groups (1.1% with one), fp8 2.1% (2.0%);
# asserted < 1.5% and < 3%.
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_bounds(groups, dtype):
    g = torch.Generator().manual_seed(0)
    # per-token magnitudes over 6 decades, and one outlier channel, as real keys have
    x = torch.randn(512, 3, 64, generator=g) * torch.logspace(-3, 3, 512)[:, None, None]
    x[:, :, 5] *= 8
    x = x.to(dtype)
    xg = x.float().unflatten(-1, (groups, -1))
    amax = xg.abs().amax(-1, keepdim=True)
    for kind, rms_bound in (("int8", 0.015), ("fp8", 0.03)):
        values, scale = quantize(x, kind, groups)
        assert values.shape == x.shape and scale.shape == (512, 3, groups)
        assert scale.dtype == SCALE_DTYPES[kind]
        y = dequantize(values, scale, torch.float32)
        err = (y.unflatten(-1, (groups, -1)) - xg).abs()
        if kind == "int8":
            assert (err <= amax / 254 * 1.004).all()
        else:
            assert (err <= xg.abs() / 16 + amax * 2**-9 / 448).all()
        rel = ((y - x.float()).norm(dim=-1) / x.float().norm(dim=-1)).square().mean().sqrt().item()
        assert rel < rms_bound, f"{kind}: relative RMS error {rel:.4f}"
        assert dequantize(values, scale, dtype).dtype == dtype


def test_int8_rotation_spreads_outlier_channels():
    """The int8 pool's Hadamard basis: an outlier channel no longer sets its group's step. Relative RMS
    error on the rows above: 0.82% plain, 0.51% rotated (SmolLM2-135M's keys: 0.89% -> 0.50%)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 3, 64, generator=g) * torch.logspace(-3, 3, 512)[:, None, None]
    x[:, :, 5] *= 8
    pool = QuantizedKVCache("int8", 4, 3, 64)
    r = pool.rot
    assert torch.allclose(r @ r, torch.eye(64), atol=1e-6) and torch.equal(r, r.T)

    def rel(y):
        return ((y - x).norm(dim=-1) / x.norm(dim=-1)).square().mean().sqrt().item()

    assert rel(pool.from_pool_basis(pool.to_pool_basis(x))) < 1e-6

    plain, rotated = rel(round_trip(x, "int8", 2)), rel(pool.round_trip(x))
    assert rotated < 0.7 * plain, (plain, rotated)
    assert QuantizedKVCache("fp8", 4, 3, 64).rot is None  # e4m3's error is relative: no basis helps
    assert QuantizedKVCache("int8", 4, 3, 80).rot.shape == (80, 80)  # 5 blocks of 16


def test_zeros_and_extremes_stay_finite():
    x = torch.zeros(4, 2, 8)
    x[1] = 3e4  # larger than any fp8 code: the scale carries the magnitude
    x[2, 0, 0] = -1e-30
    for kind in KINDS:
        y = round_trip(x, kind)
        assert torch.isfinite(y).all() and (y[0] == 0).all()
        assert torch.allclose(y[1], x[1], rtol=5e-3)  # int8: the bf16 scale's rounding
        assert torch.allclose(y[2, 0, 0], x[2, 0, 0], rtol=5e-3)


def test_pool_store_and_gather_blocks():
    """Writes land at their slots (values and scales); gathering whole blocks dequantizes them."""
    g = torch.Generator().manual_seed(1)
    bs, heads, hd = 4, 2, 64
    for kind in KINDS:
        pool = QuantizedKVCache(kind, 6 * bs, heads, hd)
        assert pool.scale.shape[-1] == num_groups(kind, hd) == {"fp8": 1, "int8": 2}[kind]
        assert pool.nbytes == 6 * bs * bytes_per_token(kind, torch.bfloat16, heads, hd)
        slots = torch.tensor([9, 10, 3, 22])
        k, v = torch.randn(2, 4, heads, hd, generator=g)
        pool.store(slots, k, v)
        got = pool.gather_blocks(1, torch.tensor([2, 0, 5]), bs, torch.float32)  # slots 8.., 0.., 20..
        assert got.shape == (3, bs, heads, hd)
        got = pool.from_pool_basis(got)
        want = pool.round_trip(v)
        assert (want - v).abs().max() < 0.05 * v.abs().max()

        def same(a, b):
            return torch.allclose(a, b, rtol=0, atol=1e-6)

        assert same(got[0, 1:3], want[:2]) and same(got[1, 3], want[2]) and same(got[2, 2], want[3])
        assert (got[0, 0] == 0).all()


def test_bytes_per_token_is_about_half_of_bf16():
    for kind in KINDS:
        # SmolLM2-135M: 3 KV heads of 64 channels; 64 bytes of values + 4 of scales per head
        assert bytes_per_token(kind, torch.bfloat16, 3, 64) == 2 * 3 * (64 + 4)
        for head_dim in (64, 80, 96, 128, 256):
            ratio = bytes_per_token("auto", torch.bfloat16, 8, head_dim) / bytes_per_token(
                kind, torch.bfloat16, 8, head_dim
            )
            assert ratio >= 1.8, (kind, head_dim, ratio)
    assert bytes_per_token("auto", torch.float32, 3, 64) == 2 * 3 * 64 * 4


def test_config_rejects_unknown_kv_cache_dtype():
    assert EngineConfig.from_kwargs(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp4'.*auto, fp8 or int8"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp4")


# -- (2) the torch backend on a quantized pool ----------------------------------------------------------
def quantized_pool(case: Case, kind: str) -> QuantizedKVCache:
    """The case's cache (context and junk alike) written through the quantized store."""
    pool = QuantizedKVCache(kind, case.cache.shape[1], NUM_KV, HD)
    pool.store(torch.arange(case.cache.shape[1]), case.cache[0], case.cache[1])
    return pool


CASES = [
    (MIXED, None, None),  # decode rows, fresh prompts, chunks with cached context
    (SPANS, 3, None),  # bidirectional spans under a sliding window
    (SPANS + [(0, 9, ())], 5, 2.0),  # softcap
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seqs,window,softcap", CASES)
def test_backend_reads_back_exactly_the_quantized_values(kind, seqs, window, softcap):
    """Every path (decode gather, context gather, fresh prompt) sees the dequantized values and nothing
    else: the output equals the float64 reference on round-tripped K/V to float32 rounding, and is
    close to the unquantized backend: relative (Frobenius) error measured ~2.3-2.5% for fp8 and ~0.5%
    for int8, asserted < 4% and < 1%."""
    case = Case(sorted(seqs, key=lambda s: s[1] != 1), seed=7)
    if softcap:
        case.q *= 4
    backend = TorchAttentionBackend()
    plain = case.run(backend, backend.plan(case.batch, torch.device("cpu")), window, softcap)
    pool = quantized_pool(case, kind)
    meta = backend.plan(case.batch, torch.device("cpu"))
    got = backend.forward(case.q, case.k, case.v, pool, meta, SCALE, window=window, softcap=softcap)
    # the step's own K/V were written into the pool at their slots, quantized
    slots = case.batch.slot_mapping
    assert torch.equal(pool.scale[0, slots], quantize(pool.to_pool_basis(case.k), kind)[1])
    case.keys = [pool.round_trip(k) for k in case.keys]
    case.values = [pool.round_trip(v) for v in case.values]
    exact = (got.double() - case.reference(window, softcap)).abs().max().item()
    assert exact < 1e-5, f"{kind}: max error {exact} against the round-tripped reference"
    drift = ((got - plain).norm() / plain.norm()).item()
    assert drift < {"fp8": 0.04, "int8": 0.01}[kind], f"{kind}: relative error {drift:.4f} vs plain"


# -- (3)-(5) the real embedded model --------------------------------------------------------------------
STORY = (
    "The lighthouse keeper had lived alone on the island for eleven years. Every evening he climbed the "
    "ninety-two steps of the tower, wiped the salt from the great lens, and lit the lamp before the sun "
    "touched the water. Ships no longer needed him; their captains trusted satellites and radar. Still, "
    "he kept the light burning, partly out of habit and partly because he believed that a coast without a "
    "lighthouse was a coast that had forgotten something important. One autumn morning a small boat "
    "drifted onto the rocks below the tower. Inside was a girl of about twelve, soaked and shivering, "
    "holding a notebook wrapped in plastic. She said her name was Mira and that she had come to learn "
    "how the light worked, because her grandfather had been the keeper before him. The old man did not "
    "know what to say. He made her tea, found her a dry sweater, and showed her the logbooks that went "
    "back more than a century, each page filled with weather, ships and small private notes. Mira read "
    "them all that winter, and by spring she could trim a wick and read a barometer better than he could."
)
NUM_DECODE = 24  # greedy fp32 continuation, teacher-forced into the quantized engines one decode at a time
POOL_BYTES = 256 * 2**20  # as llm_fp32's, so capacities compare directly


def teacher_forced(engine, prompt: list[int], forced: list[int] | None, n: int) -> dict[int, torch.Tensor]:
    """Logits at every position the engine computes, feeding `forced` as the next tokens (None: its own
    greedy choice). The prompt goes in budget-sized chunks, the continuation one decode step at a time,
    both through the engine's scheduler, runner and KV pool."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    req = Request(f"tf-{engine.config.cache.kv_cache_dtype}", list(prompt), params)
    engine.scheduler.add(req)
    logits: dict[int, torch.Tensor] = {}
    while req.status is not RequestStatus.FINISHED:
        batch = engine.scheduler.schedule()
        (s,) = batch.items
        rows = engine.runner.compute_logits(batch, all_tokens=True)
        logits.update((s.start + j, rows[j]) for j in range(s.num_tokens))
        sampled = {}
        if s.num_logits:
            n_out = req.num_output_tokens
            sampled[req.request_id] = [int(rows[-1].argmax()) if forced is None else forced[n_out]]
        engine.scheduler.update(batch, sampled)
    return logits


@pytest.fixture(scope="module")
def reference(llm_fp32):
    """The chat prompt, its greedy continuation and the per-position logits, all from the fp32 pool."""
    eng = llm_fp32.engine
    prompt = llm_fp32.processor.apply_chat_template(
        [{"role": "user", "content": "Continue this story.\n\n" + STORY}]
    )
    logits = teacher_forced(eng, prompt, None, NUM_DECODE)
    cont = [int(logits[p].argmax()) for p in range(len(prompt) - 1, len(prompt) + NUM_DECODE - 1)]
    return prompt, cont, logits


@pytest.fixture(scope="module", params=KINDS)
def quantized_llm(request, smollm_path):
    from foveal.engine.llm import LLM

    # a 32-token budget: the prompt's later chunks read their context back from the quantized pool
    return LLM(
        dtype="float32",
        quantization="none",  # the dense weights of the fp32 reference: only the pool differs
        kv_cache_memory=POOL_BYTES,
        kv_cache_dtype=request.param,
        max_num_batched_tokens=32,
    )


def test_teacher_forced_top1_agreement(quantized_llm, reference, llm_fp32):
    """Every position of a 284-token chat against the fp32 pool, all reading quantized K/V: the prompt in
    32-token chunks (the later ones gather their context from the pool), then 24 decode steps.
    Measured on SmolLM2-135M: int8 98.9-100% (flips only at top-2 margins of 0.011-0.02: near-ties that
    fp32 summation order alone can decide, e.g. oneDNN's vs MKL's GEMM), mean KL 0.0002; fp8 94.0%, KL
    0.006. So int8 must agree wherever the fp32 margin is >= 0.1, and at >= 98% of all positions.

    fp8 misses the 99% bar for a reason the format carries: e4m3 keeps 3 mantissa bits (~2% error per
    element whatever the scale; bf16 keeps 8 and agrees 100%), which moves this 30-layer model's logits
    by ~0.3 RMS, and ~8% of the positions of prose have their top two logits within 0.1. Every flip
    measured sits at a top-2 margin under 0.6 logit, so fp8 is held to 99% where fp32 leads by >= 1."""
    kind = quantized_llm.engine.config.cache.kv_cache_dtype
    prompt, cont, ref = reference
    got = teacher_forced(quantized_llm.engine, prompt, cont, NUM_DECODE)
    positions = sorted(set(ref) & set(got))
    assert len(positions) >= 256
    want = torch.stack([ref[p] for p in positions])
    have = torch.stack([got[p] for p in positions])
    agree = (want.argmax(-1) == have.argmax(-1)).float()
    top2 = want.topk(2, -1).values
    margin = top2[:, 0] - top2[:, 1]
    decided = margin >= 1.0
    lp, lq = want.log_softmax(-1), have.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean().item()
    summary = f"{kind}: agreement {agree.mean():.4f} overall, {agree[decided].mean():.4f} where decided"
    summary += f" ({int(decided.sum())}/{len(positions)}), KL {kl:.5f}, flips at top-2 margins"
    summary += f" {[round(m, 3) for m in margin[agree == 0].tolist()]}"
    print(summary)
    if kind == "int8":
        assert agree[margin >= 0.1].all() and agree.mean() >= 0.98, summary
        assert kl < 0.002, summary
    else:
        assert agree[decided].mean() >= 0.99 and decided.sum() >= 100, summary
        assert agree.mean() >= 0.9 and kl < 0.015, summary
    quantized_llm.engine.kv.check_integrity()
    assert quantized_llm.engine.kv.num_used_blocks == 0


def test_pool_holds_about_twice_the_tokens(quantized_llm, llm_fp32):
    """Same kv_cache_memory: vs this fp32 pool 3.8x the tokens; vs a bf16 pool (the GPU default) 1.88x,
    from the same bytes-per-token the engine sizes its pool with."""
    q, ref = quantized_llm.engine, llm_fp32.engine
    assert ref.config.cache.kv_cache_memory == q.config.cache.kv_cache_memory == POOL_BYTES
    kind = q.config.cache.kv_cache_dtype
    assert all(isinstance(c, QuantizedKVCache) and c.kind == kind for c in q.runner.kv_caches)
    assert q.kv.capacity_tokens >= 1.8 * ref.kv.capacity_tokens
    # the pool is sized from its real layout: its bytes (scales included) fill the budget to one block
    layers, heads, hd = q.model.kv_shape
    per_token = layers * bytes_per_token(kind, torch.float32, heads, hd)
    used = sum(c.nbytes for c in q.runner.kv_caches)
    assert used == q.runner.kv_caches[0].num_slots * per_token
    assert POOL_BYTES - per_token * q.kv.block_size < used <= POOL_BYTES
    bf16_tokens = POOL_BYTES // (layers * bytes_per_token("auto", torch.bfloat16, heads, hd))
    assert q.kv.capacity_tokens >= 1.8 * bf16_tokens


def test_prefix_cache_hits_on_quantized_blocks(quantized_llm):
    """A second identical prompt reuses the quantized blocks of the first and decodes the same tokens."""
    eng = quantized_llm.engine
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 6}]
    messages.append({"role": "user", "content": "Why is the sky blue?"})
    params = SamplingParams(temperature=0, max_tokens=12)
    before = eng.kv.stats()["hit_tokens"]
    first = quantized_llm.chat(messages, params)[0].outputs[0].token_ids
    mid = eng.kv.stats()["hit_tokens"]
    second = quantized_llm.chat(messages, params)[0].outputs[0].token_ids
    n_prompt, bs = len(quantized_llm.processor.apply_chat_template(messages)), eng.kv.block_size
    assert mid - before < bs  # at most the chat template's first block was cached before
    # every full block, but one token always runs (it gives the logits)
    assert eng.kv.stats()["hit_tokens"] - mid == (n_prompt - 1) // bs * bs
    assert second == first
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0
