"""LoRA adapters against transformers + PEFT, and the invariants of batching them: logits of random
adapters (ranks 8 and 64) equal PEFT's; a batch mixing adapters and base rows equals each request run
alone (eager, recorded CPU steps, the graph path); slots, eviction and the scheduler's adapter limit;
the prefix cache never shares K/V across adapters; loading, unloading and refusals."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import weakref

import pytest
import torch

from foveal.lora.adapter import load_adapter
from foveal.lora.peft import AdapterConfig, AdapterError, module_name
from foveal.request import FinishReason, SamplingParams
from tests.lora_models import adapter_folders, base_folder, save_adapter
from tests.tiny import Harness, tiny_hf_model

pytest.importorskip("peft")
TOL = 1e-4


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _parity(h: Harness, pm, adapter, prompts: list[list[int]], steps: int = 20) -> None:
    """Requests with the adapter (even) and without (odd), in one batch: prefill logits of every position,
    then `steps` greedy decodes, each against PEFT with the adapter on / off."""
    reqs = [
        h.add(f"r{i}", p, max_tokens=64, lora=adapter if i % 2 == 0 else None) for i, p in enumerate(prompts)
    ]

    def ref(i, ids):
        if i % 2 == 0:
            return _logits(pm, ids)
        with pm.disable_adapter():
            return _logits(pm, ids)

    batch = h.sched.schedule()
    ours = h.runner.compute_logits(batch, all_tokens=True)
    off, sampled = 0, {}
    for s in batch.items:
        i = int(s.request_id[1:])
        want = ref(i, list(s.token_ids))
        err = (ours[off : off + s.num_tokens] - want).abs().max().item()
        assert err < TOL, f"prefill of {s.request_id}: {err}"
        off += s.num_tokens
        sampled[s.request_id] = [int(ours[off - 1].argmax())]
    h.sched.update(batch, sampled)
    for _ in range(steps):
        batch = h.sched.schedule()
        ours = h.runner.compute_logits(batch)
        sampled = {}
        for row, s in enumerate(batch.items):
            want = ref(int(s.request_id[1:]), h.sched.get(s.request_id).all_token_ids)[-1]
            assert (ours[row] - want).abs().max().item() < TOL, f"decode of {s.request_id}"
            sampled[s.request_id] = [int(want.argmax())]
        h.sched.update(batch, sampled)
    for r in reqs:
        h.sched.finish(r, FinishReason.ABORT)
    h.runner.release(h.sched.take_finished())


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("rank", [8, 64])
def test_logits_equal_peft(family, rank, tmp_path):
    """PEFT's adapters on every linear; on a mixture of experts on the attention projections (PEFT
    would take the expert stacks' names as target_parameters: refused, test_expert_adapters_are_refused_
    by_name)."""
    if "moe" in family or family == "mixtral":
        pm = save_adapter(tmp_path, tiny_hf_model(family), rank, seed=rank, target_modules=list(ATTENTION))
    else:
        pm = save_adapter(tmp_path, tiny_hf_model(family), rank, seed=rank)
    h = Harness(tiny_hf_model(family), lora=(2, 64))
    adapter = load_adapter("a", str(tmp_path), h.runner.lora.layout, torch.float32, 64)
    g = torch.Generator().manual_seed(1)
    _parity(h, pm, adapter, [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 9)])


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def test_expert_adapters_are_refused_by_name(tmp_path):
    """PEFT's all-linear on a mixture of experts also targets the expert stacks and the router (as
    parameters): the load is refused with a message that says so."""
    from foveal.lora.peft import AdapterError

    save_adapter(tmp_path, tiny_hf_model("qwen3_moe"), 8, seed=1)
    h = Harness(tiny_hf_model("qwen3_moe"), lora=(2, 8))
    with pytest.raises(AdapterError, match="target_parameters.*expert stacks or router"):
        load_adapter("a", str(tmp_path), h.runner.lora.layout, torch.float32, 8)


def test_cuda_layout_in_the_interpreter_equals_peft(tmp_path):
    """The CUDA path (every slot's A stacked under the weight, one GEMM, the Triton expand) on CPU
    tensors in Triton's interpreter: PEFT's logits, base rows untouched (on CUDA: the GPU test)."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the CUDA kernel in Triton's CPU interpreter")
    pm = save_adapter(tmp_path, tiny_hf_model("qwen3"), 8, seed=6)
    h = Harness(tiny_hf_model("qwen3"), lora=(2, 8, True))
    assert all(st.W_ext is not None for st in h.runner.lora.stacks.values())
    adapter = load_adapter("a", str(tmp_path), h.runner.lora.layout, torch.float32, 8)
    _parity(h, pm, adapter, [[3, 9, 4, 7, 1], [8, 2, 6]], steps=3)


def test_grouped_gemm_path_equals_peft(tmp_path, monkeypatch):
    """The CPU path without the native kernel (no compiler, or a half-precision model): grouped GEMMs."""
    from foveal.lora import stacks

    monkeypatch.setattr(stacks, "_cpu_kernel", lambda: None)
    pm = save_adapter(tmp_path, tiny_hf_model("qwen2"), 16, seed=5)
    h = Harness(tiny_hf_model("qwen2"), lora=(2, 16))
    adapter = load_adapter("a", str(tmp_path), h.runner.lora.layout, torch.float32, 16)
    _parity(h, pm, adapter, [[7, 1, 8, 2, 8], [1, 8, 2]], steps=4)


def test_rslora_patterns_and_partial_targets_equal_peft(tmp_path):
    """rsLoRA scaling, per-module rank and alpha patterns, and an adapter on q/v/down only (the other
    slices of the fused q/k/v stay zero)."""
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (7, 4)]
    for i, extra in enumerate(
        [
            dict(use_rslora=True, rank_pattern={"k_proj": 4, "down_proj": 12}, alpha_pattern={"o_proj": 3.0}),
            dict(target_modules=["q_proj", "v_proj", "down_proj"]),
        ]
    ):
        folder = tmp_path / str(i)
        pm = save_adapter(folder, tiny_hf_model("qwen3"), 16, seed=i, **extra)
        h = Harness(tiny_hf_model("qwen3"), lora=(1, 16))
        adapter = load_adapter("a", str(folder), h.runner.lora.layout, torch.float32, 16)
        _parity(h, pm, adapter, prompts, steps=5)


def test_a_slot_rewritten_with_a_smaller_rank_keeps_no_stale_rows(tmp_path):
    """One slot: a rank-64 adapter, then a rank-8 one in its place; the second must match PEFT exactly
    (the slot is zeroed before it is written)."""
    big = save_adapter(tmp_path / "big", tiny_hf_model("llama"), 64, seed=1)
    small = save_adapter(tmp_path / "small", tiny_hf_model("llama"), 8, seed=2)
    h = Harness(tiny_hf_model("llama"), lora=(1, 64))
    layout = h.runner.lora.layout
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6]]
    _parity(h, big, load_adapter("big", str(tmp_path / "big"), layout, torch.float32, 64), prompts, steps=2)
    _parity(h, small, load_adapter("small", str(tmp_path / "small"), layout, torch.float32, 64), prompts, 2)
    assert h.runner.lora.num_loads == 2


# -- engine level: mixed batches, graphs, scheduling ----------------------------------------------------


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    base = base_folder(tmp_path_factory.mktemp("base"), "qwen3")
    return base, adapter_folders(tmp_path_factory, "qwen3", ranks=(8, 16, 8, 16))


def _llm(base, **kw):
    from foveal import LLM

    opts = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, num_blocks=96, block_size=4)
    return LLM(base, **{**opts, **kw})


PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _outs(llm, prompts, loras):
    out = llm.generate(prompts, PARAMS, lora_request=loras)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in out]


def _same(got, want, tol=1e-5):
    for (toks, lps), (wt, wl) in zip(got, want):
        assert toks == wt
        assert max(abs(a - b) for a, b in zip(lps, wl)) < tol


def _peft_agrees(outs, loras, prompts, adapters) -> None:
    """Greedy tokens of the adapter requests equal PEFT's generate (on the CPU)."""
    for (toks, _), lr, p in zip(outs, loras, prompts):
        if lr is not None:
            pm = adapters[int(lr.lora_name[1:])][1]
            with torch.no_grad():
                want = pm.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
            assert toks == want[0, len(p) :].tolist()


def _mixed_requests(adapters):
    from foveal import LoRARequest

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 11, 6, 17, 8, 5, 12)]
    loras = [
        None,
        *(LoRARequest(f"a{i}", path) for i, (path, _) in enumerate(adapters)),
        None,
        LoRARequest("a0", adapters[0][0]),
    ]
    return prompts, loras


@pytest.mark.parametrize("path", ["recorded", "eager", "graph"])
def test_mixed_batch_equals_each_request_alone(lora_setup, path):
    """Four adapters and base rows in one batch (prompts of different lengths: prefill, then decodes)
    give each request the tokens and logprobs it gets alone, and equal PEFT's greedy tokens."""
    from foveal.worker.cpu_graphs import CpuDecodeGraphs
    from foveal.worker.cuda_graphs import DecodeGraphs

    base, adapters = lora_setup
    llm = _llm(base, enforce_eager=path != "recorded", device="cpu")
    runner = llm.engine.runner
    if path == "recorded":
        assert isinstance(runner.graphs, CpuDecodeGraphs)
    elif path == "graph":  # the CUDA graphs' static-buffer forward, run eagerly on the CPU
        runner.graphs = DecodeGraphs(
            llm.engine.model, runner.kv_caches, runner.backend, block_size=4, max_seqs=8, max_model_len=96,
            device="cpu", lora_groups=runner.lora.num_slots + 1,
        )  # fmt: skip
    prompts, loras = _mixed_requests(adapters)
    alone = [_outs(llm, [p], [lr])[0] for p, lr in zip(prompts, loras)]
    _same(_outs(llm, prompts, loras), alone)
    if path == "graph":
        calls = []
        run = runner.graphs.run
        runner.graphs.run = lambda *a, **kw: calls.append(a[3]) or run(*a, **kw)  # a[3]: the adapter groups
        _same(_outs(llm, prompts, loras), alone)
        assert any(
            g and any(s < runner.lora.num_slots for s, _ in g) for g in calls
        )  # adapters took the graph
    _peft_agrees(alone, loras, prompts, adapters)
    assert llm.engine.kv.num_used_blocks == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_serve_every_mixture_of_adapters(lora_setup):
    """On CUDA (Triton kernels, captured graphs, async scheduling): mixed batches equal each request
    alone, with the mixture changing between replays of the same graphs; base-only steps replay the
    graphs without LoRA kernels."""
    from foveal import LoRARequest

    base, adapters = lora_setup
    llm = _llm(base, device="cuda")
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.lora_graphs and not graphs.emulated
    prompts, loras = _mixed_requests(adapters)
    alone = [_outs(llm, [p], [lr])[0] for p, lr in zip(prompts, loras)]
    replays = {"plain": 0, "lora": 0}
    for name, table in (("plain", graphs.graphs), ("lora", graphs.lora_graphs)):
        for b, g in list(table.items()):
            table[b] = _Counted(g, replays, name)
    _same(_outs(llm, prompts, loras), alone, 1e-4)
    rotated = [
        None
        if lr is None
        else LoRARequest(f"a{(int(lr.lora_name[1:]) + 1) % 4}", adapters[(int(lr.lora_name[1:]) + 1) % 4][0])
        for lr in loras
    ]
    alone_rot = [_outs(llm, [p], [lr])[0] for p, lr in zip(prompts, rotated)]
    _same(_outs(llm, prompts, rotated), alone_rot, 1e-4)
    assert replays["plain"] and replays["lora"]
    _peft_agrees(alone, loras, prompts, adapters)
    assert llm.engine.kv.num_used_blocks == 0


class _Counted:
    def __init__(self, graph, counts, name):
        self.graph, self.counts, self.name = graph, counts, name

    def replay(self):
        self.counts[self.name] += 1
        self.graph.replay()


def test_scheduler_runs_at_most_max_loras_adapters_and_lets_others_pass(lora_setup):
    """max_loras=2 with requests of three adapters: never more than two adapters running; a request
    whose adapter does not fit waits while a base request behind it runs; all equal their alone runs."""
    from foveal import LoRARequest

    base, adapters = lora_setup
    llm = _llm(base, max_loras=2, enforce_eager=True)
    eng = llm.engine
    loras = [LoRARequest(f"a{i}", adapters[i][0]) for i in range(3)] + [None]
    prompts = [[5 + i, 6, 7, 8] for i in range(4)]
    alone = [_outs(llm, [p], [lr])[0] for p, lr in zip(prompts, loras)]
    reqs = [
        eng.add_request(dataclasses.replace(llm.processor.request(p, PARAMS), lora=llm._adapter(lr)))
        for p, lr in zip(prompts, loras)
    ]
    seen, got, reports = [], {r: [] for r in reqs}, []
    while eng.has_unfinished():
        names = {r.lora.uid for r in eng.scheduler.running if r.lora is not None}
        assert len(names) <= 2
        for d in eng.step():
            got[d.request_id] += d.token_ids
        seen.append({r.request_id for r in eng.scheduler.running})
        reports.append(eng.lora_report())
    # what the metrics export: per adapter name, sequences running and waiting
    assert reports[0] == {"running": {"a0": 1, "a1": 1}, "waiting": {"a2": 1}, "max_loras": 2}
    assert any(r["running"].get("a2") == 1 for r in reports) and reports[-1]["running"] == {}
    assert reqs[3] in seen[0] and reqs[2] not in seen[0]  # the base request passed the waiting adapter
    assert [got[r] for r in reqs] == [a[0] for a in alone]
    assert eng.runner.lora.num_loads >= 3


def test_prefix_cache_never_shared_across_adapters(lora_setup):
    from foveal import LoRARequest

    base, adapters = lora_setup
    llm = _llm(base, enable_prefix_caching=True, enforce_eager=True)
    a, b = (LoRARequest(f"a{i}", adapters[i][0]) for i in range(2))
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks of 4 can be reused

    def cached(lr):
        before = llm.engine.kv.hit_tokens
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), lora_request=lr)
        return llm.engine.kv.hit_tokens - before

    assert cached(a) == 0
    assert cached(b) == 0  # same prompt, another adapter
    assert cached(None) == 0  # the base model
    assert cached(a) == 20  # the same adapter again: every full block
    assert cached(b) == 20 and cached(None) == 20
    # unloaded and loaded again under the same name: a new load, none of the old K/V
    reg = llm.processor.lora
    assert reg.unload("a0")
    assert cached(LoRARequest("a0", adapters[0][0])) == 0


def test_load_unload_storm_beside_running_requests(lora_setup):
    """Adapters registered, used and unloaded while other requests run: every request finishes with
    the tokens it gets alone, no KV block stays used, the slots keep their memory, and an unloaded
    adapter's host copy is freed once its requests are done."""
    from foveal import LoRARequest

    base, adapters = lora_setup
    llm = _llm(base, max_loras=2, max_cpu_loras=2, enforce_eager=True)
    eng, reg = llm.engine, llm.processor.lora
    slots_bytes = eng.runner.lora.nbytes
    prompts = [[9, 8, 7, 6, 5, 4], [1, 2, 3], [44, 55, 66, 77]]
    ref = {}
    for i in range(4):
        ref[i] = _outs(llm, [prompts[i % 3]], [LoRARequest(f"s{i}", adapters[i][0])])[0][0]
        reg.unload(f"s{i}")
    ref[None] = _outs(llm, [prompts[0]], [None])[0][0]
    want, got, refs = {}, {}, []
    step = 0
    for round_ in range(3):
        for i in range(4):
            name = f"storm{round_}-{i}"
            adapter = reg.load(name, adapters[i][0])
            refs.append(weakref.ref(adapter))
            er = llm.processor.request(prompts[i % 3], PARAMS)
            rid = eng.add_request(dataclasses.replace(er, lora=adapter))
            want[rid], got[rid] = ref[i], []
            del adapter, er
            base_rid = eng.add_request(llm.processor.request(prompts[0], PARAMS))
            want[base_rid], got[base_rid] = ref[None], []
            for d in eng.step():
                got[d.request_id] += d.token_ids
            assert reg.unload(name)  # gone for new requests; the running one keeps its copy
            step += 1
    while eng.has_unfinished():
        for d in eng.step():
            got[d.request_id] += d.token_ids
    assert got == want
    assert eng.kv.num_used_blocks == 0
    assert eng.runner.lora.nbytes == slots_bytes and reg.host_bytes == 0
    gc.collect()
    assert all(r() is None for r in refs)  # no adapter outlives its requests


# -- the format: config, names, refusals ---------------------------------------------------------


def test_scaling_follows_peft():
    c = AdapterConfig.parse(
        {
            "r": 16,
            "lora_alpha": 32,
            "rank_pattern": {"k_proj": 4},
            "alpha_pattern": {"layers.1.mlp.down_proj": 8},
        }
    )
    assert c.scaling("model.layers.0.self_attn.q_proj") == 2.0
    assert c.scaling("model.layers.0.self_attn.k_proj") == 8.0  # alpha 32 / its rank 4
    assert c.scaling("model.layers.1.mlp.down_proj") == 0.5
    assert c.scaling("model.layers.0.mlp.down_proj") == 2.0
    rs = AdapterConfig.parse({"r": 16, "lora_alpha": 8, "use_rslora": True})
    assert rs.scaling("model.layers.0.self_attn.q_proj") == 2.0  # 8 / sqrt(16)


@pytest.mark.parametrize(
    "field,value",
    [
        ("peft_type", "IA3"),
        ("use_dora", True),
        ("modules_to_save", ["lm_head"]),
        ("bias", "all"),
        ("lora_bias", True),
        ("fan_in_fan_out", True),
        ("target_parameters", ["experts.w1"]),
        ("layer_replication", [[0, 2]]),
        ("init_lora_weights", "pissa_niter_4"),
    ],
)
def test_unsupported_config_is_refused_by_name(field, value):
    with pytest.raises(AdapterError, match=field):
        AdapterConfig.parse({"r": 8, "lora_alpha": 16, field: value})


def test_tensor_names():
    assert module_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight") == (
        "model.layers.0.self_attn.q_proj",
        "A",
    )
    for bad in (
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",
        "base_model.model.lm_head.weight",
    ):
        with pytest.raises(AdapterError, match="not a LoRA A/B weight"):
            module_name(bad)


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    from safetensors.torch import save_file

    h = Harness(tiny_hf_model("llama"), lora=(1, 16))
    layout = h.runner.lora.layout

    def write(name, tensors, config=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config or {"r": 8, "lora_alpha": 16}))
        save_file(tensors, str(d / "adapter_model.safetensors"))
        return str(d)

    p = "base_model.model.model.layers.0.self_attn."
    ok_a, ok_b = torch.zeros(8, 64), torch.zeros(64, 8)  # q_proj: 64 x 64
    qa, qb = p + "q_proj.lora_A.weight", p + "q_proj.lora_B.weight"
    head = "base_model.model.lm_head."
    cases = {
        "lm head": (
            {head + "lora_A.weight": ok_a, head + "lora_B.weight": torch.zeros(256, 8)},
            "not supported",
        ),
        "other base": ({qa: torch.zeros(8, 32), qb: ok_b}, "do not fit"),
        "half": ({qa: ok_a}, "missing"),
        "rank": ({qa: torch.zeros(32, 64), qb: torch.zeros(64, 32)}, "max-lora-rank"),
    }
    for name, (tensors, why) in cases.items():
        with pytest.raises(AdapterError, match=why):
            load_adapter(name, write(name.replace(" ", "_"), tensors), layout, torch.float32, 16)
    with pytest.raises(AdapterError, match="no LoRA adapter config"):
        load_adapter("x", str(tmp_path / "nowhere"), layout, torch.float32, 16)


def test_offline_api_errors(lora_setup):
    from foveal import LLM, LoRARequest

    base, adapters = lora_setup
    plain = LLM(base, dtype="float32", num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[1, 2]], PARAMS, lora_request=LoRARequest("a", adapters[0][0]))
    llm = _llm(base)
    llm.generate([[1, 2]], PARAMS, lora_request=LoRARequest("a", adapters[0][0]))
    with pytest.raises(ValueError, match="already registered with path"):
        llm.generate([[1, 2]], PARAMS, lora_request=LoRARequest("a", adapters[1][0]))
    assert LoRARequest("x", 3, "/p").lora_path == "/p"  # vLLM's (name, int id, path)
    with pytest.raises(ValueError, match="2 LoRA requests for 1 prompts"):
        llm.generate([[1, 2]], PARAMS, lora_request=[None, None])


def test_vlm_language_model_adapter_equals_peft(tmp_path):
    """A VLM (LLaVA): an adapter on its language model routes through the VLM's checkpoint prefixes and
    generates PEFT's tokens on a text prompt; vision-tower and projector modules are refused."""
    from foveal import LLM, LoRARequest
    from tests.tiny_vlm import build_llava

    tiny = build_llava(str(tmp_path / "vlm"))
    target = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    pm = save_adapter(tmp_path / "adapter", tiny.hf, 8, seed=7, target_modules=target)
    llm = LLM(
        tiny.path,
        dtype="float32",
        device="cpu",
        enable_lora=True,
        max_lora_rank=8,
        num_blocks=64,
        block_size=4,
    )
    layout = llm.engine.runner.lora.layout
    assert layout.route("model.language_model.layers.1.mlp.up_proj")[0].name.endswith(
        "layers.1.mlp.gate_up_proj"
    )
    for module in (
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj",
        "model.multi_modal_projector.linear_1",
    ):
        with pytest.raises(AdapterError, match="not supported"):
            layout.route(module)
    prompt = [5, 9, 14, 3, 22, 8]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate([prompt], params, lora_request=LoRARequest("v", str(tmp_path / "adapter")))
    with torch.no_grad():
        want = pm.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
        with pm.disable_adapter():
            base = pm.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got[0].outputs[0].token_ids == want[0, len(prompt) :].tolist()
    assert want[0, len(prompt) :].tolist() != base[0, len(prompt) :].tolist()  # the adapter matters


def test_slots_never_evict_an_adapter_in_use(tmp_path):
    """Two slots, three adapters: a slot whose adapter a held request uses is never the victim, even
    when it is the least recently used; a step's own adapters are never evicted by each other."""
    from collections import Counter

    h = Harness(tiny_hf_model("llama"), lora=(2, 8))
    driver = h.sched.lora
    ads = []
    for i in range(3):
        save_adapter(tmp_path / str(i), tiny_hf_model("llama"), 8, seed=i)
        ads.append(load_adapter(f"x{i}", str(tmp_path / str(i)), h.runner.lora.layout, torch.float32, 8))
    x0, x1, x2 = ads
    assert driver.slots_for([x0]) == ({x0.uid: 0}, [(0, x0)])
    assert driver.slots_for([x1]) == ({x1.uid: 1}, [(1, x1)])  # x0 is now the least recently used
    assert driver.slots_for([x0]) == ({x0.uid: 0}, [])  # resident: no write
    assert driver.slots_for([x1]) == ({x1.uid: 1}, [])  # x0 is the least recently used again
    held = Counter({x0.uid: 1})  # a request with x0 is running
    assert driver.slots_for([x2], held) == ({x2.uid: 1}, [(1, x2)])  # x1 goes, not x0
    assert driver.resident == [x0.uid, x2.uid]
    # the step's x0 stays, though the least recently used
    assert driver.slots_for([x1, x0], Counter()) == ({x0.uid: 0, x1.uid: 1}, [(1, x1)])
    with pytest.raises(RuntimeError, match="max-loras"):
        driver.slots_for(ads)


def test_a_step_plan_gives_slots_and_keeps_the_adapters_of_unfinished_requests():
    """LoRADriver.plan: per item its slot (the base model's: num_slots), a write only for an adapter not
    resident, None for a step without adapters; the adapter of an unfinished request (waiting too) is
    evicted after one no request uses, even when it is the least recently used."""
    from types import SimpleNamespace as NS

    from foveal.lora.driver import LoRADriver

    d = LoRADriver(2)
    a, b, c = (NS(uid=i, name=f"x{i}") for i in range(3))
    reqs = {"r0": NS(lora=a), "r1": NS(lora=None), "r2": NS(lora=b)}
    items = [NS(request_id=k) for k in reqs]
    step = d.plan(items, reqs)
    assert step.slots == (0, 2, 1) and step.loads == ((0, a), (1, b))
    assert d.plan(items[1:2], reqs) is None
    assert d.plan(items[2:], reqs).loads == ()  # b resident; a is now the least recently used
    # r2 (b) finished, r0 (a) waits: c takes b's slot
    step = d.plan([NS(request_id="r3")], {"r0": reqs["r0"], "r3": NS(lora=c)})
    assert step.slots == (1,) and step.loads == ((1, c),)
    assert d.resident == [a.uid, c.uid]


def test_speculative_decoding_with_adapters_is_lossless(lora_setup):
    """n-gram speculation on a LoRA engine: verify rows run with their request's adapter (drafts too),
    so greedy output equals the plain LoRA engine's, adapters and base rows mixed."""
    base, adapters = lora_setup
    prompts, loras = _mixed_requests(adapters)
    prompts = [p * 3 for p in prompts]  # repeats give the n-gram proposer something to draft
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    outs = {}
    for name, kw in (("plain", {}), ("spec", {"speculative_config": spec})):
        llm = _llm(base, device="cpu", **kw)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    assert outs["spec"] == outs["plain"]
    assert llm.engine.speculation.stats.num_draft_tokens > 0


def test_hub_ids_resolve_through_the_hub_loader(tmp_path, monkeypatch):
    """A Hub id goes to loader/hub.download_repo (mocked: no network in tests); a path that is neither
    a folder nor a repo id is refused by name."""
    from foveal.loader import hub
    from foveal.lora.peft import resolve

    calls = []
    monkeypatch.setattr(hub, "download_repo", lambda repo: calls.append(repo) or str(tmp_path))
    assert resolve("org/my-adapter") == str(tmp_path) and calls == ["org/my-adapter"]
    assert resolve(str(tmp_path)) == str(tmp_path) and len(calls) == 1  # a folder is used as is
    with pytest.raises(AdapterError, match="neither a folder nor a Hub repo id"):
        resolve("/no/such/folder")
