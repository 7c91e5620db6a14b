"""Mixture-of-experts: the grouped expert computation against the plain loop, the router against its
formula, the published per-expert checkpoint layouts, and a Qwen3-MoE folder served end to end.
(Logits parity with transformers per family: test_model_parity.py's FAMILIES.)"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from foveal.layers.moe import experts_grouped, experts_reference, route
from tests.tiny import tiny_hf_model


def _experts(E, H, inter, dtype, g):
    w13 = torch.randn(E, 2 * inter, H, generator=g).to(dtype) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g).to(dtype) / inter**0.5
    return w13, w2


@pytest.mark.parametrize("E,k,T", [(1, 1, 5), (4, 2, 1), (8, 2, 17), (16, 4, 64), (6, 3, 3), (32, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_the_loop(E, k, T, dtype):
    """Random shapes, expert counts and top-k (some experts chosen by no token, some by many): the
    grouped GEMMs give the loop's output."""
    g = torch.Generator().manual_seed(E * 100 + k * 10 + T)
    H, inter = 64, 48
    w13, w2 = _experts(E, H, inter, dtype, g)
    x = torch.randn(T, H, generator=g).to(dtype)
    weights, ids = route(torch.randn(T, E, generator=g), k)
    got = experts_grouped(x, w13, w2, weights, ids)
    want = experts_reference(x, w13, w2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and (got.float() - want.float()).abs().max().item() < tol
    # the loop is the definition: token t's output is the weighted sum of its experts' MLPs
    t, x32 = T - 1, x[T - 1].float()

    def mlp(e):
        gate, up = F.linear(x32, w13[e, :inter].float()), F.linear(x32, w13[e, inter:].float())
        return F.linear(F.silu(gate) * up, w2[e].float())

    direct = sum(float(weights[t, j]) * mlp(e) for j, e in enumerate(ids[t].tolist()))
    assert (want[t].float() - direct).abs().max().item() < (1e-5 if dtype == torch.float32 else 5e-2)


def test_grouped_experts_with_biases_and_the_clamped_swiglu():
    """gpt-oss's experts (a bias after each projection, the clamped SwiGLU) on the grouped path."""
    from foveal.layers.moe import ClampedSwiGLU

    g = torch.Generator().manual_seed(8)
    E, H, inter, T = 8, 64, 32, 21
    w13, w2 = _experts(E, H, inter, torch.float32, g)
    b13, b2 = torch.randn(E, 2 * inter, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g) * 4
    weights, ids = route(torch.randn(T, E, generator=g), 4)
    glu = ClampedSwiGLU(1.702, 7.0)
    got = experts_grouped(x, w13, w2, weights, ids, glu, b13, b2)
    want = experts_reference(x, w13, w2, weights, ids, glu, b13, b2)
    assert (got - want).abs().max().item() < 1e-5
    assert (want - experts_reference(x, w13, w2, weights, ids, glu)).abs().max().item() > 0.1


def test_unaligned_shapes_take_the_loop():
    """Rows whose byte stride is not a multiple of 16 (what torch._grouped_mm needs) still compute."""
    g = torch.Generator().manual_seed(3)
    w13, w2 = _experts(4, 6, 5, torch.float32, g)
    x = torch.randn(7, 6, generator=g)
    weights, ids = route(torch.randn(7, 4, generator=g), 2)
    want = experts_reference(x, w13, w2, weights, ids)
    assert torch.allclose(experts_grouped(x, w13, w2, weights, ids), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's experts paths")
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "clamped-swiglu+biases"])
@pytest.mark.parametrize("path", ["triton", "grouped"])
@pytest.mark.parametrize("H,inter", [(128, 64), (120, 36)], ids=["aligned", "unaligned"])
def test_cuda_experts_paths_equal_the_loop_eager_and_in_a_graph(path, gpt_oss, H, inter, monkeypatch):
    """FusedMoE.routed on CUDA with bf16 weights through each experts path (moe.CUDA_EXPERTS): the loop's
    output on the same routing, eager and replayed from a CUDA graph (no host sync inside: capture would
    fail), for 1, 7 and 40 tokens (the router's logits inside the routing's launch for the first two,
    by its Linear for 40). Rows the grouped GEMMs cannot take (36 bf16 values: not 16-byte aligned) go
    to the Triton kernel, not the loop."""
    from foveal.layers import moe
    from foveal.layers.linear import Linear
    from foveal.layers.moe import ClampedSwiGLU, FusedMoE

    monkeypatch.setattr(moe, "CUDA_EXPERTS", path)
    g = torch.Generator().manual_seed(11)
    E, k = 16, 4
    layer = FusedMoE(E, H, inter, ClampedSwiGLU(1.702, 7.0) if gpt_oss else moe.silu_glu, bias=gpt_oss)
    router = Linear(H, E, bias=gpt_oss)
    with torch.no_grad():
        for prm in (*layer.parameters(), *router.parameters()):
            prm.copy_(torch.randn(prm.shape, generator=g) / H**0.5)
    layer, router = layer.to("cuda", torch.bfloat16), router.to("cuda", torch.bfloat16)
    for T in (1, 7, 40):
        x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
        # the logits as both routes compute them (float32 sums rounded once; near-ties decide experts)
        b = None if router.bias is None else router.bias.float()
        weights, ids = route(F.linear(x.float(), router.weight.float(), b).to(x.dtype), k)
        want = experts_reference(x, layer.w13, layer.w2, weights, ids, layer.glu, layer.gate_up_proj_bias,
                                 layer.down_proj_bias).float()  # fmt: skip
        tol = 5e-2 * want.abs().max().item()
        eager = layer.routed(x, router, k).float()
        assert (eager - want).abs().max().item() < tol
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer.routed(x, router, k)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer.routed(x, router, k)
        graph.replay()
        torch.cuda.synchronize()
        assert (out.float() - want).abs().max().item() < tol  # (index_add_'s atomics: not bit-equal)


def test_routing_is_softmax_top_k():
    """Softmax over all experts, the top k, renormalized or not; renormalized equals Mixtral's way
    round (top k of the logits, softmax over those)."""
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(0))
    w, ids = route(logits, 3, renormalize=False)
    p = torch.softmax(logits, -1)
    assert torch.equal(ids, p.topk(3, -1).indices) and torch.allclose(w, p.gather(1, ids))
    w, ids = route(logits, 3)
    top, idx = logits.topk(3, -1)
    assert torch.equal(ids, idx) and torch.allclose(w, torch.softmax(top, -1), atol=1e-6)
    assert torch.allclose(w.sum(-1), torch.ones(9))


def published_state_dict(hf) -> dict[str, torch.Tensor]:
    """The checkpoint layout the Hub's files use: one tensor per expert and projection (Qwen3-MoE:
    mlp.experts.E.{gate,up,down}_proj; Mixtral: block_sparse_moe.experts.E.{w1,w3,w2} and its gate)
    instead of transformers 5's fused [E, ...] stacks."""
    mixtral = type(hf).__name__.startswith("Mixtral")
    out = {}
    for name, t in hf.state_dict().items():
        if ".mlp.experts." not in name:
            if mixtral and name.endswith(".mlp.gate.weight"):
                name = name.replace(".mlp.", ".block_sparse_moe.")
            out[name] = t
            continue
        prefix, stack = name.rsplit(".", 1)
        if mixtral:
            prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        names = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
        for e in range(t.shape[0]):
            if stack == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.{names[0]}.weight"] = gate.clone()
                out[f"{prefix}.{e}.{names[1]}.weight"] = up.clone()
            else:
                out[f"{prefix}.{e}.{'w2' if mixtral else 'down_proj'}.weight"] = t[e].clone()
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_published_layout_loads_to_the_same_model(family):
    from foveal.attention import get_backend
    from foveal.models import build_model

    hf = tiny_hf_model(family)
    published = published_state_dict(hf)
    assert any(".experts.3." in n for n in published) and not any("gate_up_proj" in n for n in published)
    models = [
        build_model(
            hf.config,
            get_backend("torch", "cpu"),
            max_positions=64,
            dtype=torch.float32,
            device="cpu",
            weights=iter(w.items()),
        )  # fmt: skip
        for w in (hf.state_dict(), published)
    ]
    for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()):
        assert torch.equal(a, b)
    missing = {n: t for n, t in published.items() if ".experts.1." not in n}
    with pytest.raises(ValueError, match="missing weights"):
        build_model(hf.config, get_backend("torch", "cpu"), max_positions=64, dtype=torch.float32,
                    device="cpu", weights=iter(missing.items()))  # fmt: skip


def moe_model(cfg, arch: str = "Qwen3MoeForCausalLM"):
    """A random transformers mixture of `cfg` whose routers score experts apart (no ties in the top k)."""
    import transformers as tf

    torch.manual_seed(0)
    hf = getattr(tf, arch)(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    cfg.architectures = [arch]
    return hf


def save_tiny_moe_folder(path) -> str:
    """A tiny random Qwen3-MoE folder in the published safetensors layout, with the byte tokenizer."""
    from safetensors.torch import save_file

    from tests.tiny import tiny_config
    from tests.tiny_vlm import byte_tokenizer

    tok = byte_tokenizer([], "")
    cfg = tiny_config("qwen3_moe")
    cfg.vocab_size = len(tok)
    cfg.bos_token_id, cfg.eos_token_id = tok.bos_token_id, tok.eos_token_id
    cfg.pad_token_id = tok.pad_token_id
    hf = moe_model(cfg)
    cfg.save_pretrained(path)
    save_file({n: t.contiguous() for n, t in published_state_dict(hf).items()}, f"{path}/model.safetensors")
    tok.save_pretrained(path)
    assert "moe_intermediate_size" in json.loads((path / "config.json").read_text())
    return hf


def test_a_served_moe_model_answers_like_transformers(tmp_path):
    """A Qwen3-MoE checkpoint in the published layout: offline greedy tokens equal transformers'
    generate, batched with other prompts; the server answers the same through the official client."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from tests.test_server import serving

    hf = save_tiny_moe_folder(tmp_path)
    prompts = ["hello experts", "a", "mixture of experts, routed"]
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ids = llm.processor.tokenizer(prompt)["input_ids"]
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(ids) :].tolist(), prompt
    with serving({"model": str(tmp_path), "block_size": 4}, {}) as s:
        r = s.client().completions.create(
            model=s.model, prompt=prompts[0], max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == 12 and r.choices[0].text == outs[0].outputs[0].text
    assert s.engine.kv.num_used_blocks == 0


# -- GGUF: llama.cpp's qwen3moe layout ------------------------------------------------------------------
def _gguf_moe(tmp_path, quantize=None, arch: str = "qwen3moe"):
    """A tiny mixture written as llama.cpp writes it: qwen3moe (every layer sparse, the top k
    renormalized: what its converter and runtime do), or Mixtral as `llama` with experts (q/k rows
    permuted); ffn_{gate,up,down}_exps [E, rows, cols] and ffn_gate_inp."""
    import transformers as tf

    from tests.test_loader import tiny_vocab, write_gguf

    common = dict(
        vocab_size=len(tiny_vocab()), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts_per_tok=2,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    if arch == "llama":
        cfg = tf.MixtralConfig(**common, intermediate_size=32, num_local_experts=4, sliding_window=None)
        hf = moe_model(cfg, "MixtralForCausalLM")
    else:
        cfg = tf.Qwen3MoeConfig(
            **common, intermediate_size=128, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True
        )
        hf = moe_model(cfg)
    path = tmp_path / f"tiny-{arch}-moe.gguf"
    write_gguf(path, arch, hf, quantize=quantize)
    return hf, str(path)


@pytest.mark.parametrize("arch", ["qwen3moe", "llama"])
def test_a_moe_gguf_loads_as_transformers_has_it(tmp_path, arch):
    """F32 tensors: the experts come one by one (under Qwen3-MoE's Hub names), the config carries the
    experts' counts, and greedy tokens equal transformers' on the original model."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from foveal.loader.checkpoint import load_checkpoint

    hf, path = _gguf_moe(tmp_path, arch=arch)
    ckpt = load_checkpoint(path, dtype=torch.float32)
    cfg = ckpt.hf_config
    assert type(cfg) is type(hf.config) and cfg.architectures == hf.config.architectures
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (hf.config.num_experts, 2)
    got = dict(ckpt.weights)
    assert sum(".mlp.experts." in n for n in got) == 2 * 3 * hf.config.num_experts
    if arch == "qwen3moe":
        want = published_state_dict(hf)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    llm = LLM(path, dtype="float32", quantization="none", block_size=4, num_blocks=128)
    prompts = [[5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()


def test_quantized_gguf_experts_run_packed(tmp_path):
    """Q4_0 gate/up and Q8_0 down experts with --quantization gguf: every expert runs on its rows of
    the packed stacks, which unpack to what the dense engine dequantized; next-token log-probabilities
    stay near the dense engine's; batched equals single."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from foveal.layers import quant

    if quant.kernel() is None:
        pytest.skip("no quantized-linear kernel on this machine")
    _, path = _gguf_moe(tmp_path, {"ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q8_0"})
    kw = dict(dtype="float32", block_size=4, num_blocks=128, device="cpu")  # packed GGUF weights: CPU only
    q, d = LLM(path, quantization="gguf", **kw), LLM(path, quantization="none", **kw)
    dense = dict(d.engine.model.named_parameters())
    packed = {n: p._foveal_quant for n, p in q.engine.model.named_parameters() if hasattr(p, "_foveal_quant")}
    assert sorted(packed) == sorted(
        f"layers.{i}.mlp.experts.{s}" for i in range(2) for s in ("gate_up_proj", "down_proj")
    )  # fmt: skip
    for name, qw in packed.items():
        torch.testing.assert_close(qw.dequantize(), dense[name], rtol=0, atol=1e-6, msg=name)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for ids in ([5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40]):
        lq, ld = (llm.generate([ids], params)[0].outputs[0].logprobs[0].top for llm in (q, d))
        lq, ld = {t.token_id: t.logprob for t in lq}, {t.token_id: t.logprob for t in ld}
        top = max(ld, key=ld.get)
        assert max(lq, key=lq.get) == top and abs(lq[top] - ld[top]) < 0.05, (lq, ld)
    prompts = [[5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40], [11, 12]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in q.generate(prompts, greedy)]
    assert together == [q.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]


def test_moe_composes_with_prefix_caching_async_steps_and_kv_quantization(tmp_path):
    """On the tiny Qwen3-MoE folder: prompts sharing a prefix give the same greedy tokens with the
    prefix cache and overlapped steps as without (and the cache was hit); an int8 KV cache runs."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM

    save_tiny_moe_folder(tmp_path)
    shared = "a shared system prefix that spans several blocks of the cache. "
    prompts = [shared + tail for tail in ("one", "the second", "3", "four four")]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(dtype="float32", block_size=4, num_blocks=256)
    plain = LLM(str(tmp_path), enable_prefix_caching=False, async_scheduling=False, **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    cached = LLM(str(tmp_path), enable_prefix_caching=True, async_scheduling=True, **kw)
    for p, w in zip(prompts, want):  # one at a time: each later prompt finds the shared blocks
        assert cached.generate([p], params)[0].outputs[0].token_ids == w
    assert cached.engine.kv.hit_tokens >= 3 * (len(shared) // 4 * 4 - 4)
    int8 = LLM(str(tmp_path), kv_cache_dtype="int8", **kw)
    out = int8.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 10 for o in out) and int8.engine.kv.num_used_blocks == 0


def test_an_eagle3_head_on_a_moe_target_is_lossless(tmp_path):
    """EAGLE-3 reads a mixture's hidden states like a dense model's: greedy tokens with the head equal
    those without, and drafts were accepted."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from tests.test_loader import tiny_hf_tokenizer, tiny_model
    from tests.test_spec_heads import write_eagle3

    target = tmp_path / "target"
    tiny_model("qwen3_moe", seed=0, layers=4).save_pretrained(target)
    tiny_hf_tokenizer().save_pretrained(target)
    head = write_eagle3(tmp_path / "eagle3")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 17, 9)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(dtype="float32", num_blocks=200, block_size=4, max_num_seqs=8, max_model_len=160)
    plain = [o.outputs[0].token_ids for o in LLM(str(target), **kw).generate(prompts, params)]
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(str(target), speculative_config=spec, **kw)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.speculation.stats.num_drafts > 0
