"""The quantized-linear kernel (layers/cpu_quant.c via layers/quant.py) against straightforward formulas:
GGUF blocks unpacked as gguf's own dequantize does, and y = dequant(W) @ q8(x)^T with x rounded to int8
per block of 32 (what llama.cpp's Q8_1 does); then the engine on the real GGUF model."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from foveal.layers import linear as lin
from foveal.layers import quant
from tests.gguf_blocks import (
    WRITERS,
    check_against_dense,
    random_blocks,
    within_int8_step,
    within_q4_k_rounding,
)

# alone: the kernels' OpenMP paths on torch's threads (`make test` runs the rest on one thread a worker)
pytestmark = pytest.mark.alone

needs_kernel = pytest.mark.skipif(quant.kernel() is None, reason="no AVX2 CPU or C compiler")
KINDS = ["Q4_0", "Q4_1", "Q8_0"]


def gguf_weight(kind: str, n: int, k: int, seed: int = 0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    raw = quantize(w.numpy(), GGMLQuantizationType[kind])
    return torch.from_numpy(raw), torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]))


def q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel quantizes activations: per block of 32, scale max|x| / 127, a = x times
    127 / max|x| (in fp32, as the kernel: x / scale would round a few ties the other way) to nearest even."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    # torch.full_like(amax, 127) / amax divides; 127 / amax would take reciprocal(amax) * 127
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax.clamp_min(1e-30), 0)
    a = torch.round(xb * inv).clamp(-127, 127)
    return (a * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("kind", KINDS)
def test_unpacks_gguf_blocks_as_gguf_does(kind):
    raw, w = gguf_weight(kind, 21, 96)
    qw = quant.QuantWeight.from_gguf(raw, kind, 21, 96)
    assert (qw.out_features, qw.in_features) == (21, 96)
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m,n,k", [(1, 8, 32), (3, 13, 64), (4, 24, 96), (5, 100, 576), (33, 40, 160)])
def test_kernel_matches_formula(kind, m, n, k):
    raw, w = gguf_weight(kind, n, k, seed=m)
    qw = quant.QuantWeight.from_gguf(raw, kind, n, k)
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    if k > 32:
        x[0, :32] = 0.0  # an all-zero block (scale 0)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        got = qw.linear(x, b)
        want = q8_blocks(x) @ w.t() + (0 if b is None else b)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ w.t()
    assert (qw.linear(x) - exact).norm() / exact.norm() < 0.02  # what int8 activations cost


def test_scales_are_packed_as_fp16_and_other_values_are_refused():
    """The packed blocks keep GGUF's fp16 scales (0.625 byte a Q4 weight, as the file); a scale that
    fp16 cannot hold exactly is an error, not a rounded weight."""
    raw, w = gguf_weight("Q4_1", 16, 64)
    qw = quant.QuantWeight.from_gguf(raw, "Q4_1", 16, 64)
    assert qw.nbytes == 16 * 64 * 5 // 8
    q, d, m = quant.planes_from_gguf(raw, "Q4_1", 16, 64)
    with pytest.raises(ValueError, match="not float16 values"):
        quant.QuantWeight(q, d + 1e-4, m, "Q4_1")
    with pytest.raises(ValueError, match="the m scales"):
        quant.QuantWeight(q, d, m * 1.0001, "Q4_1")


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [44, 48, 64])  # an odd number of panels, an even one, a partial last panel
@pytest.mark.parametrize("m", [1, 13])  # under 8 rows the CPU's build takes its narrower tiles
def test_wide_and_avx2_builds_agree_bit_for_bit(kind, dtype, n, m, monkeypatch):
    """The CPU's own build (AVX-512 and VNNI where it has them) and the AVX2-only build
    (-DFOVEAL_AVX2_ONLY, what a CPU without them runs) sum the same exact integers and apply the same
    float operations in the same order: their outputs are identical. On a plain AVX2 CPU both builds
    are the AVX2 one and this only checks that the flag builds."""
    k = 576
    raw, _ = gguf_weight(kind, n, k, seed=7)
    qw = quant.QuantWeight.from_gguf(raw, kind, n, k)
    g = torch.Generator().manual_seed(3)
    # extreme activations too: a row at +-max with all-positive and all-negative blocks
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[-1] = torch.where(torch.arange(k) % 3 == 0, -1e3, 1e3).to(dtype)
    bias = torch.randn(n, generator=g)
    native_out = qw.linear(x, bias)
    avx2 = quant.build(wide=False)
    assert avx2 is not None
    monkeypatch.setattr(quant, "kernel", lambda: avx2)
    assert torch.equal(qw.linear(x, bias), native_out)


@needs_kernel
def test_int8_weights_at_the_int16_limits():
    """Q8_0 q = -128 / 127 against activations at +-127: every vpmaddubsw pair sum is 2 * 128 * 127, so
    accumulating two of them in int16 (or q = -128 losing its sign) would show."""
    n, k = 16, 64
    q = torch.full((n, k), 127, dtype=torch.int8)
    q[:, ::2] = -128
    q[1::2] *= -1  # -128 * -1 stays -128 in int8: rows of -128 / -127 too
    d = torch.full((n, k // 32, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    raw = torch.cat([d, q.view(torch.uint8).reshape(n, k // 32, 32)], dim=2).reshape(n, -1)
    qw = quant.QuantWeight.from_gguf(raw, "Q8_0", n, k)
    w = q.float() * torch.tensor(0.01, dtype=torch.float16).float()
    torch.testing.assert_close(qw.dequantize(), w, rtol=0, atol=0)
    x = torch.where(torch.arange(k) % 2 == 0, -1.0, 1.0).repeat(5, 1)
    x[1] *= -1
    want = q8_blocks(x) @ w.t()
    torch.testing.assert_close(qw.linear(x), want, rtol=1e-6, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_in_bf16_out(kind):
    raw, w = gguf_weight(kind, 24, 64)
    qw = quant.QuantWeight.from_gguf(raw, kind, 24, 64)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = qw.linear(x)
    assert got.dtype == torch.bfloat16
    want = (q8_blocks(x) @ w.t()).bfloat16()
    # one bf16 rounding of an fp32 sum whose terms (the planes of Q8_0) may cancel
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-3 * scale)


@needs_kernel
def test_strided_and_batched_input():
    raw, w = gguf_weight("Q4_1", 16, 64)
    qw = quant.QuantWeight.from_gguf(raw, "Q4_1", 16, 64)
    wide = torch.randn(5, 128)
    x = wide[:, 32:96]  # rows at stride 128
    torch.testing.assert_close(qw.linear(x), qw.linear(x.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(qw.linear(x.reshape(5, 1, 64)).squeeze(1), qw.linear(x), rtol=0, atol=0)
    rows = [qw.linear(x[i : i + 1]) for i in range(5)]  # each row alone == in the batch, bit for bit
    torch.testing.assert_close(torch.cat(rows), qw.linear(x), rtol=0, atol=0)


def test_assemble_fused_shards():
    shards = [("Q4_1", 16, 1), ("Q4_1", 8, 2), ("Q4_0", 8, 3)]
    (rq, wq), (rk, wk), (rv, wv) = (gguf_weight(t, n, 64, s) for t, n, s in shards)
    qw = quant.assemble([(24, "Q4_0", rv), (0, "Q4_1", rq), (16, "Q4_1", rk)], 32, 64)
    torch.testing.assert_close(qw.dequantize(), torch.cat([wq, wk, wv]), rtol=0, atol=1e-6)
    assert qw.kind == "Q4_0+Q4_1"
    r8, w8 = gguf_weight("Q8_0", 8, 64)
    mixed = quant.assemble([(0, "Q4_1", rq), (16, "Q8_0", r8)], 24, 64)  # one int8 pack: Q4_1 requantized
    assert mixed.int8 and mixed.kind == "Q4_1+Q8_0"
    got = mixed.dequantize()
    torch.testing.assert_close(got[16:], w8, rtol=0, atol=0)
    assert within_int8_step(got[:16], wq)
    assert quant.assemble([(0, "Q4_1", rq), (24, "Q4_0", rv)], 32, 64) is None  # rows 16-23 missing


def test_k_quant_writers_read_back_through_gguf():
    """The tests' Q4_K / Q6_K writers (gguf-py writes neither) give blocks that gguf's own dequantize reads
    back near the weights, as near as its Q4_1 and Q8_0 quantizers do theirs."""
    a = (torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 0.05).numpy()
    for kind, near in (("Q4_K", "Q4_1"), ("Q6_K", "Q5_0")):
        got = dequantize(WRITERS[kind](a), GGMLQuantizationType[kind]).reshape(a.shape)
        ref = dequantize(quantize(a, GGMLQuantizationType[near]), GGMLQuantizationType[near])
        assert abs(got - a).mean() < 1.2 * abs(ref.reshape(a.shape) - a).mean(), kind


@pytest.mark.parametrize("kind", quant.REPACKED)
def test_repacked_types_keep_their_values_within_bounds(kind):
    """K-quants and the 5-bit types, from random blocks: the dequantized values are gguf's; the packs
    hold them within their bounds: Q4_K 2^-11 of each of its terms (scale and min rounded to fp16), at
    most 3 x 2^-11 of its block's largest weight; Q5_0 exactly; the rest half an int8 step."""
    raw = torch.from_numpy(random_blocks(kind, 24, 512, seed=len(kind)))
    want = torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[kind]).reshape(24, 512))
    assert torch.equal(quant.dequantize(raw, kind, 512), want)  # the values lookups read
    qw = quant.QuantWeight.from_gguf(raw, kind, 24, 512)
    got = qw.dequantize()
    assert qw.int8 == (kind != "Q4_K")
    if kind == "Q4_K":
        assert within_q4_k_rounding(got, want)
    elif kind == "Q5_0":  # int8 q - 16 with its own d
        assert torch.equal(got, want)
    else:
        assert within_int8_step(got, want)


@needs_kernel
@pytest.mark.parametrize("kind", quant.REPACKED)
@pytest.mark.parametrize("m,n,k", [(1, 8, 256), (5, 13, 512), (33, 40, 768)])
def test_kernel_runs_repacked_types(kind, m, n, k):
    raw = torch.from_numpy(random_blocks(kind, n, k, seed=m, scale=1e-4))
    qw = quant.QuantWeight.from_gguf(raw, kind, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    torch.testing.assert_close(qw.linear(x), q8_blocks(x) @ qw.dequantize().t(), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_native_experts_match_the_formula_and_each_token_alone():
    """quant.moe (one native call for a mixture's experts) against the formula on the dequantized packs
    (activations rounded to int8 per block, as the kernel does: x for gate/up, silu(gate) * up for down),
    and each token's output alone the same bits as in the batch: 20 tokens, 6 experts of mixed formats
    (Q4_K and Q6_K gate/up, Q6_K and Q4_0 down), so some experts take 8 rows or more (the zmm tiles where
    the CPU has them) and alone one."""
    H, inter, E, k, T = 256, 256, 6, 2, 20
    kinds13, kinds2 = ["Q4_K", "Q6_K"] * 3, ["Q6_K", "Q4_0", "Q6_K"] * 2

    def pack(kind, n, cols, seed):
        raw = torch.from_numpy(random_blocks(kind, n, cols, seed=seed, scale=1e-3))
        return quant.QuantWeight.from_gguf(raw, kind, n, cols)

    w13 = [pack(kinds13[e], 2 * inter, H, e) for e in range(E)]
    w2 = [pack(kinds2[e], H, inter, 10 + e) for e in range(E)]
    packs = quant.ExpertPacks(w13, w2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[:10, 0] = 3  # expert 3 gets 10 rows or more
    weights = torch.rand(T, k, generator=g)
    got = quant.moe(x, weights, ids, packs)
    want = torch.zeros(T, H)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = q8_blocks(x[t : t + 1]) @ w13[e].dequantize().t()
            act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
            want[t] += weights[t, j] * (q8_blocks(act) @ w2[e].dequantize().t())[0]
    # an act rounding to the other int8 step (the kernel's SiLU is not torch's, to an ulp) moves a sum by
    # one step times its weights: 1e-3 of the outputs' scale bounds it
    assert (got - want).abs().max() <= 1e-3 * want.abs().max()
    for t in range(T):
        assert torch.equal(quant.moe(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], packs)[0], got[t]), t
    bf = quant.moe(x.bfloat16(), weights, ids, packs)
    assert bf.dtype == torch.bfloat16
    assert (bf.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_bad_shapes_are_named():
    raw, _ = gguf_weight("Q4_1", 8, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.QuantWeight.from_gguf(raw, "Q4_1", 8, 48)
    with pytest.raises(ValueError, match="no quantized kernel for Q2_K"):
        quant.planes_from_gguf(raw, "Q2_K", 8, 64)
    with pytest.raises(ValueError, match="Q6_K weight with 64 columns: not a multiple of 256"):
        quant.planes_from_gguf(raw, "Q6_K", 8, 64)
    if quant.kernel() is not None:
        qw = quant.QuantWeight.from_gguf(raw, "Q4_1", 8, 64)
        with pytest.raises(ValueError, match="96 features, the weight 64"):
            qw.linear(torch.randn(2, 96))


@needs_kernel
def test_linear_dispatch_and_fallback(monkeypatch):
    raw, w = gguf_weight("Q4_1", 16, 64)
    weight = w.clone()
    weight._foveal_quant = quant.QuantWeight.from_gguf(raw, "Q4_1", 16, 64)
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin.linear(x, weight), weight._foveal_quant.linear(x), rtol=0, atol=0)
    monkeypatch.setattr(quant, "kernel", lambda: None)  # a machine without the kernel: dense weights
    torch.testing.assert_close(lin.linear(x, weight), x @ w.t(), rtol=1e-5, atol=1e-5)


# a Q4_K_M file's mix (llama.cpp's): Q4_K, with Q6_K for v, down and the output head
Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
          "ffn_up": "Q4_K", "ffn_down": "Q6_K", "token_embd": "Q4_K", "output": "Q6_K"}  # fmt: skip


@needs_kernel
def test_a_q4_k_m_file_runs_packed(tmp_path):
    """A tiny Llama written with Q4_K_M's types runs every linear packed: Q4_K as 4-bit, Q6_K and the
    fused q/k/v (Q6_K v beside Q4_K q and k) as int8, near the values the dense engine dequantized;
    next-token log-probabilities stay near the dense engine's; batched equals single."""
    import transformers as tf

    from foveal.engine.llm import LLM
    from tests.test_loader import tiny_vocab, write_gguf

    cfg = tf.LlamaConfig(
        vocab_size=len(tiny_vocab()), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "tiny-q4_k_m.gguf"
    write_gguf(path, "llama", tf.LlamaForCausalLM(cfg).eval(), quantize=Q4_K_M)
    kw = dict(dtype="float32", block_size=4, num_blocks=128, device="cpu")
    q, d = LLM(str(path), quantization="gguf", **kw), LLM(str(path), quantization="none", **kw)
    assert quant.describe(q.engine.model).startswith("9 quantized weights (4 Q4_K, 2 Q4_K+Q6_K, 3 Q6_K;")
    dense = dict(d.engine.model.named_parameters())
    for name, p in q.engine.model.named_parameters():
        qw = getattr(p, "_foveal_quant", None)
        if qw is not None:
            want, got = dense[name].detach(), qw.dequantize()
            assert qw.int8 == (qw.kind != "Q4_K"), name
            assert within_int8_step(got, want) if qw.int8 else within_q4_k_rounding(got, want), name
    check_against_dense(q, d)


@pytest.fixture(scope="module")
def llm_q4(smollm_path):
    """The embedded model with its Q4_1 / Q8_0 weights run as stored."""
    if quant.kernel() is None:
        pytest.skip("no AVX2 CPU or C compiler")
    from foveal.engine.llm import LLM

    return LLM(dtype="float32", quantization="gguf", kv_cache_memory=64 * 2**20)


def _first_logprobs(llm, ids):
    from foveal import SamplingParams

    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=10))[0].outputs[0]
    return {t.token_id: t.logprob for t in out.logprobs[0].top}


def test_real_model_packs_equal_its_dense_weights(llm_q4, llm_fp32):
    """Every pack (fused q/k/v and gate/up shards, llama.cpp's q/k row order undone, the Q8_0 head)
    unpacks to the parameter the dense engine's loader dequantized (gguf's own dequantize). The packed
    engine holds dense values only for the embedding, which lookups read (and the tied head packs)."""
    model = llm_q4.engine.model
    assert quant.describe(model).startswith("121 quantized weights (120 Q4_1, 1 Q8_0;")
    dense = dict(llm_fp32.engine.model.named_parameters())
    assert quant.describe(llm_fp32.engine.model) == "dense weights"
    packed = 0
    for name, p in model.named_parameters():
        if (qw := getattr(p, "_foveal_quant", None)) is not None:
            torch.testing.assert_close(qw.dequantize(), dense[name].float(), rtol=0, atol=1e-6, msg=name)
            packed += 1
    assert packed == 121
    name, embed = next((n, p) for n, p in model.named_parameters() if n.endswith("embed_tokens.weight"))
    torch.testing.assert_close(embed, dense[name], rtol=0, atol=0)


def test_shards_of_4_bit_and_int8_blocks_share_an_int8_pack():
    """A fused weight whose shards came as raw blocks of both formats (Q8_0 beside Q4_1; a Q4_K_M file's
    Q6_K v beside Q4_K q and k) runs as one int8 pack, the 4-bit shards requantized."""
    from foveal.models.weights import ParamFiller

    module = torch.nn.Linear(64, 24, bias=False)
    (rq, wq), (r8, w8) = gguf_weight("Q4_1", 16, 64, 1), gguf_weight("Q8_0", 8, 64, 2)
    filler = ParamFiller(module)
    for offset, (kind, raw) in ((0, ("Q4_1", rq)), (16, ("Q8_0", r8))):
        t = torch.empty(raw.shape[0], 64, device="meta")
        t.gguf_blocks = (kind, raw)
        filler.put("weight", t, f"shard at {offset}", offset=offset, rows=raw.shape[0])
    filler.check_complete()
    qw = module.weight._foveal_quant
    assert qw.int8 and qw.kind == "Q4_1+Q8_0"
    torch.testing.assert_close(qw.dequantize()[16:], w8, rtol=0, atol=0)
    assert within_int8_step(qw.dequantize()[:16], wq)


def test_real_model_quantized_next_token_close_to_dense(llm_q4, llm_fp32):
    assert quant.describe(llm_fp32.engine.model) == "dense weights"
    for text in ("The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"):
        ids = llm_q4.tokenizer.encode(text)
        q, d = _first_logprobs(llm_q4, ids), _first_logprobs(llm_fp32, ids)
        assert max(q, key=q.get) == max(d, key=d.get), text
        shared = q.keys() & d.keys()
        assert len(shared) >= 7, text
        top = max(d, key=d.get)
        assert abs(q[top] - d[top]) < 0.1, (text, q, d)
        # int8 activations over 30 layers move the tail by up to ~0.35 nats (a broken pack: whole nats)
        assert max(abs(q[t] - d[t]) for t in shared) < 0.6, (text, q, d)


def test_real_model_quantized_batched_equals_single(llm_q4):
    from foveal import SamplingParams

    texts = ("Once upon a time", "The three primary colors are", "1, 2, 3,")
    prompts = [llm_q4.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True)
    together = llm_q4.generate(prompts, params)
    for p, both in zip(prompts, together):
        alone = llm_q4.generate([p], params)[0].outputs[0]
        assert alone.token_ids == both.outputs[0].token_ids
        got = [lp.logprob for lp in both.outputs[0].logprobs]
        want = [lp.logprob for lp in alone.logprobs]
        assert got == pytest.approx(want, abs=1e-4)
    assert llm_q4.engine.kv.num_used_blocks == 0


def test_real_model_recorded_steps_equal_eager(llm_q4):
    """Recorded decode steps (worker/cpu_graphs.py) on the quantized model: every kernel of the step is
    native and row-independent, so even padded buckets give eager's tokens and log-probs bit for bit."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from foveal.worker.cpu_graphs import CpuDecodeGraphs

    eager = LLM(dtype="float32", quantization="gguf", kv_cache_memory=64 * 2**20, enforce_eager=True)
    texts = ("Once upon a time", "The three primary colors are", "1, 2, 3,", "def add(a, b):", "Paris is")
    prompts = [llm_q4.tokenizer.encode(t) for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True) for n in (9, 7, 5, 3)]
    params.append(SamplingParams(temperature=0, max_tokens=2, logprobs=2, ignore_eos=True))
    graphs = llm_q4.engine.runner.graphs
    assert isinstance(graphs, CpuDecodeGraphs)
    got, want = llm_q4.generate(prompts, params), eager.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [t.logprob for t in g.outputs[0].logprobs] == [t.logprob for t in w.outputs[0].logprobs]
    assert {4, 8} <= {b for b, t in graphs.tapes.items() if t}  # 5 and 3 rows run padded to 8 and 4
