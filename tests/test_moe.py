"""Mixture-of-experts: the grouped expert computation against the plain loop, the router against its
formula, the published per-expert checkpoint layouts, and a Qwen3-MoE folder served end to end.
(Logits parity with transformers per family: test_model_parity.py's FAMILIES.)"""

from __future__ import annotations

import json
from functools import partial

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


def _replayed(fn):
    """fn() captured in a CUDA graph (after a warm-up run on a side stream) and replayed once: its
    output. Capture fails where fn holds a host sync."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


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
        out = _replayed(partial(layer.routed, x, router, k))
        assert (out.float() - want).abs().max().item() < tol  # (index_add_'s atomics: not bit-equal)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's experts kernel")
@pytest.mark.parametrize("H,inter,b", [(256, 128, 128), (128, 64, 32)])
def test_cuda_fp8_experts_equal_the_loop_on_their_dequantized_weights(H, inter, b):
    """FusedMoE with FP8 experts (filled expert by expert as a Qwen3-*-FP8 checkpoint's are) routed on
    CUDA, eager and replayed from a CUDA graph: the loop's output on the weights the blocks dequantize
    to, for 1, 7 and 40 tokens (the router inside the routing's launch for the first two)."""
    from foveal.layers.linear import Linear
    from foveal.layers.moe import FusedMoE
    from foveal.models.weights import ParamFiller
    from tests.tiny import fp8_blocks

    g = torch.Generator().manual_seed(12)
    E, k = 16, 4
    layer = FusedMoE(E, H, inter, fp8_block=b)
    filler = ParamFiller(layer)
    w13, w2 = torch.empty(E, 2 * inter, H), torch.empty(E, H, inter)
    for e in range(E):
        for target, want, off in (("gate_up_proj", w13[e], 2 * e * inter), ("down_proj", w2[e], e * H)):
            q, s, deq = fp8_blocks(torch.randn(want.shape, generator=g) / want.shape[1] ** 0.5, (b, b))
            q.fp8_scale_inv, q.fp8_block = s, (b, b)
            filler.put(target, q, f"experts.{e}", off, len(want))
            want.copy_(deq)
    filler.check_complete()
    router = Linear(H, E, bias=False)
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=g) / H**0.5)
    layer, router = layer.to("cuda"), router.to("cuda", torch.bfloat16)
    w13, w2 = w13.to("cuda", torch.bfloat16), w2.to("cuda", torch.bfloat16)
    for T in (1, 7, 40):
        x = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
        weights, ids = route(F.linear(x.float(), router.weight.float()).to(x.dtype), k)
        want = experts_reference(x, w13, w2, weights, ids).float()
        tol = 5e-2 * want.abs().max().item()
        assert (layer.routed(x, router, k).float() - want).abs().max().item() < tol
        assert (layer(x, weights, ids).float() - want).abs().max().item() < tol
        out = _replayed(partial(layer.routed, x, router, k))
        assert (out.float() - want).abs().max().item() < tol


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


# -- FP8 checkpoints: experts kept as stored ---------------------------------------------------------
def save_fp8_moe_folder(path, block: tuple[int, int]):
    """save_tiny_moe_folder's model with every projection block-quantized to FP8 (Qwen3-*-FP8's layout:
    float8_e4m3fn weights and their weight_scale_inv, quantization_config fp8 with weight_block_size);
    returns the transformers model, its weights set to what the FP8 ones dequantize to."""
    from safetensors.torch import save_file

    from tests.tiny import fp8_blocks

    hf = save_tiny_moe_folder(path)
    state, dequantized = {}, {}
    for name, t in published_state_dict(hf).items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"], dequantized[name] = fp8_blocks(t.float(), block)
        else:
            state[name] = t
    save_file({n: t.contiguous() for n, t in state.items()}, f"{path}/model.safetensors")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg))
    with torch.no_grad():  # transformers' stacks from the per-expert tensors
        for name, p in hf.named_parameters():
            if name in dequantized:
                p.copy_(dequantized[name])
            elif ".mlp.experts." in name:
                prefix, stack = name.rsplit(".", 1)
                parts = ("gate_proj", "up_proj") if stack == "gate_up_proj" else ("down_proj",)
                per = [
                    torch.cat([dequantized[f"{prefix}.{e}.{q}.weight"] for q in parts]) for e in range(len(p))
                ]
                p.copy_(torch.stack(per))
    return hf


@pytest.mark.parametrize("block", [(16, 16), (16, 32)], ids=["kept", "non-square-dequantized"])
def test_an_fp8_moe_checkpoint_answers_like_transformers(tmp_path, block):
    """A Qwen3-MoE FP8 folder: its experts stay FP8 where the blocks allow (square, whole blocks per
    expert: uint8 stacks and their scales, the CPU running a dequantized copy), else they load
    dequantized like every other projection; either way greedy tokens equal transformers' on the
    dequantized weights, batched."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM

    hf = save_fp8_moe_folder(tmp_path, block)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=256)
    experts = llm.engine.model.layers[0].mlp.experts
    kept = block == (16, 16)
    assert experts.fp8_block == (16 if kept else None)
    assert experts.gate_up_proj.dtype == (torch.uint8 if kept else torch.float32)
    if kept:  # E x 2I / 16 rows of scales, H / 16 columns: the checkpoint's, as float32 bits
        assert experts.gate_up_proj_scale_inv.shape == (8 * 64 // 16, 64 // 16)
    prompts = ["hello experts", "a", "mixture of experts, routed"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = llm.processor.tokenizer(prompt)["input_ids"]
        with torch.no_grad():  # argmax over every token, EOS included (generate's min_new_tokens masks it)
            for _ in range(10):
                ids = ids + [int(hf(torch.tensor([ids])).logits[0, -1].argmax())]
        assert out.outputs[0].token_ids == ids[-10:], prompt


def test_fp8_experts_refuse_what_they_cannot_hold():
    """Into FP8 experts: an FP8 tensor without its scales, one in other blocks, and a dense tensor are
    refused by name; into dense parameters an FP8 tensor comes dequantized."""
    from foveal.layers.moe import FusedMoE
    from foveal.models.weights import ParamFiller
    from tests.tiny import fp8_blocks

    E, H, inter = 2, 32, 16
    moe = FusedMoE(E, H, inter, fp8_block=16)
    filler = ParamFiller(moe)
    w = torch.randn(inter, H)

    def fp8(block):
        q, s, deq = fp8_blocks(w, block)
        q.fp8_scale_inv, q.fp8_block = s, block
        return q, deq

    q, deq = fp8((16, 16))
    filler.put("gate_up_proj", q, "experts.0.gate_proj.weight", 0, inter)
    with pytest.raises(ValueError, match="without its scales"):
        filler.put("gate_up_proj", q.clone(), "experts.0.up_proj.weight", inter, inter)
    with pytest.raises(ValueError, match="blocks"):
        filler.put("gate_up_proj", fp8((16, 32))[0], "experts.0.up_proj.weight", inter, inter)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        filler.put("gate_up_proj", w, "experts.0.up_proj.weight", inter, inter)
    with pytest.raises(ValueError, match="FP8 experts in 16-blocks"):
        FusedMoE(E, 24, inter, fp8_block=16)
    dense = FusedMoE(E, H, inter)
    ParamFiller(dense).put("gate_up_proj", q, "experts.0.gate_proj.weight", 0, inter)
    assert torch.equal(dense.gate_up_proj[:inter], deq)


def test_fp8_experts_dequantize_to_their_checkpoint_and_dummy_weights_stay_finite():
    """Filled expert by expert, the stacks dequantize (CPU's copy) to each expert's weight as its
    blocks give it; the dummy loader's FP8 experts are finite with the N(0, 0.02) spread of the rest."""
    from foveal.layers.moe import FusedMoE
    from foveal.loader.dummy import randomize_weights
    from foveal.models.weights import ParamFiller
    from tests.tiny import fp8_blocks

    E, H, inter, b = 3, 48, 32, 16
    g = torch.Generator().manual_seed(5)
    moe = FusedMoE(E, H, inter, fp8_block=b)
    filler = ParamFiller(moe)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    want13, want2 = torch.empty_like(w13), torch.empty_like(w2)
    for e in range(E):  # up before gate, down first: rows land by offset, not by order
        pieces = (
            ("down_proj", w2[e], want2[e], e * H, H),
            ("gate_up_proj", w13[e, inter:], want13[e, inter:], (2 * e + 1) * inter, inter),
            ("gate_up_proj", w13[e, :inter], want13[e, :inter], 2 * e * inter, inter),
        )
        for target, w, want, off, rows in pieces:
            q, s, deq = fp8_blocks(w.contiguous(), (b, b))
            q.fp8_scale_inv, q.fp8_block = s, (b, b)
            filler.put(target, q, f"experts.{e}.weight", off, rows)
            want.copy_(deq)
    filler.check_complete()
    d13, d2 = moe._dense(torch.float32)
    assert torch.equal(d13, want13) and torch.equal(d2, want2)
    x = torch.randn(5, H, generator=g)
    weights, ids = route(torch.randn(5, E, generator=g), 2)
    assert torch.allclose(moe(x, weights, ids), experts_reference(x, want13, want2, weights, ids), atol=1e-5)
    randomize_weights(moe)
    moe._dequantized = None
    d13, d2 = moe._dense(torch.float32)
    assert d13.isfinite().all() and d2.isfinite().all()
    assert 0.015 < d13.std().item() < 0.025 and 0.015 < d2.std().item() < 0.025


@pytest.mark.parametrize(
    "q,want",
    [
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 128),
        ({"quant_method": "fp8", "weight_block_size": [128, 64]}, None),  # not square
        ({"quant_method": "fp8", "weight_block_size": [96, 96]}, None),  # not a power of two
        ({"quant_method": "fp8", "weight_block_size": [512, 512]}, None),  # 768 rows an expert: 1.5 blocks
        ({"quant_method": "fp8"}, None),  # per-tensor scales
        (
            {
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["mlp.experts"],
            },
            None,
        ),
        (None, None),
    ],
)
def test_which_fp8_experts_run_as_stored(q, want):
    from types import SimpleNamespace

    from foveal.layers.fp8 import expert_block

    assert expert_block(SimpleNamespace(quantization_config=q), 2048, 768) == want


# -- GGUF: llama.cpp's qwen3moe layout ------------------------------------------------------------------
def _gguf_moe(tmp_path, quantize=None, arch: str = "qwen3moe", hidden: int = 64, expert_width: int = 32):
    """A tiny mixture written as llama.cpp writes it: qwen3moe (every layer sparse, the top k
    renormalized: what its converter and runtime do), or Mixtral as `llama` with experts (q/k rows
    permuted); ffn_{gate,up,down}_exps [E, rows, cols] and ffn_gate_inp."""
    import transformers as tf

    from tests.test_loader import tiny_vocab, write_gguf

    common = dict(
        vocab_size=len(tiny_vocab()), hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts_per_tok=2,
        tie_word_embeddings=False, rms_norm_eps=1e-6,
    )  # fmt: skip
    if arch == "llama":
        cfg = tf.MixtralConfig(
            **common, intermediate_size=expert_width, num_local_experts=4, sliding_window=None
        )
        hf = moe_model(cfg, "MixtralForCausalLM")
    else:
        cfg = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            num_experts=8,
            moe_intermediate_size=expert_width,
            norm_topk_prob=True,
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


@pytest.mark.parametrize(
    "kinds,arch",
    [(("Q4_0", "Q8_0"), "qwen3moe"), (("Q4_K", "Q6_K"), "qwen3moe"), (("Q4_K", "Q6_K"), "llama")],
    ids=["q4_0-q8_0", "q4_k-q6_k", "mixtral-q4_k-q6_k"],
)
def test_quantized_gguf_experts_run_packed(tmp_path, kinds, arch):
    """Q4_0 gate/up and Q8_0 down experts (or Q4_K_M's Q4_K and Q6_K; Qwen3-MoE, and Mixtral as `llama`)
    with --quantization gguf: every expert runs on its rows of the packed stacks, which unpack to what the
    dense engine dequantized (Q4_K and Q6_K within their repacking's bounds); next-token log-probabilities
    stay near the dense engine's; batched equals single; the experts run in one native call a layer,
    recorded steps equal to eager."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from foveal.layers import quant
    from tests.gguf_blocks import check_against_dense, within_int8_step, within_q4_k_rounding

    if quant.kernel() is None:
        pytest.skip("no quantized-linear kernel on this machine")
    four, eight = kinds
    widths = {} if four == "Q4_0" else dict(hidden=256, expert_width=256)  # K-quants: rows of 256
    _, path = _gguf_moe(
        tmp_path, {"ffn_gate_exps": four, "ffn_up_exps": four, "ffn_down_exps": eight}, arch, **widths
    )
    kw = dict(dtype="float32", block_size=4, num_blocks=128, device="cpu")  # packed GGUF weights: CPU only
    q, d = LLM(path, quantization="gguf", **kw), LLM(path, quantization="none", **kw)
    assert q.engine.model.layers[0].mlp.experts._native_packs() is not None  # one native call a layer
    dense = dict(d.engine.model.named_parameters())
    packed = {n: p._foveal_quant for n, p in q.engine.model.named_parameters() if hasattr(p, "_foveal_quant")}
    assert sorted(packed) == sorted(
        f"layers.{i}.mlp.experts.{s}" for i in range(2) for s in ("gate_up_proj", "down_proj")
    )  # fmt: skip
    for name, qw in packed.items():
        got, want = qw.dequantize(), dense[name].detach()
        if four == "Q4_0":
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)
        else:
            assert within_int8_step(got, want) if qw.int8 else within_q4_k_rounding(got, want), name
    check_against_dense(q, d)
    # the decode steps recorded (worker/cpu_graphs.py: the experts' call has no host sync) == eager
    eager = LLM(path, quantization="gguf", enforce_eager=True, **kw)
    prompts = [[5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40]]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    for a, b in zip(q.generate(prompts, greedy), eager.generate(prompts, greedy)):
        assert [t.logprob for t in a.outputs[0].logprobs] == [t.logprob for t in b.outputs[0].logprobs]


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
