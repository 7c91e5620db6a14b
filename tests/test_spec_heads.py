"""Drafters that read the target's hidden states (EAGLE-3, MTP): random-weight heads written in their
published checkpoint layouts and loaded through `--speculative-config`. Greedy output equals plain
greedy token for token in mixed batches; every draft equals a dense reference of the head computed
from transformers' hidden states of the target; the runner reports exactly the confirmed rows' hidden
states (verify rows up to the last accepted draft)."""

from __future__ import annotations

import json

import pytest
import torch

from foveal import SamplingParams
from foveal.speculative.proposer import split_drafts
from tests.test_speculative import MIXED_GREEDY

H, HEADS, KV, HD, INTER, VOCAB, DRAFT_VOCAB = 64, 4, 2, 16, 128, 1000, 96
AUX = [1, 2, 3]  # the target layers the EAGLE-3 head reads (the target has 4)


def _eagle3_tensors(seed: int, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "fc.weight": w(H, 3 * H, scale=0.1),
        "midlayer.input_layernorm.weight": 1 + w(H),
        "midlayer.hidden_norm.weight": 1 + w(H),
        "midlayer.post_attention_layernorm.weight": 1 + w(H),
        "midlayer.self_attn.q_proj.weight": w(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": w(INTER, H),
        "midlayer.mlp.up_proj.weight": w(INTER, H),
        "midlayer.mlp.down_proj.weight": w(H, INTER),
        "norm.weight": 1 + w(H),
        "lm_head.weight": w(DRAFT_VOCAB, H, scale=1.0),
    }
    # the draft vocabulary: DRAFT_VOCAB distinct target ids, stored as offsets (target = draft + d2t)
    ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values
    t["d2t"] = ids - torch.arange(DRAFT_VOCAB)
    t["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    return t


def write_eagle3(folder, seed: int = 0, vocab: int = VOCAB, **config) -> str:
    """A random EAGLE-3 head in the published layout (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 256,
        "rope_theta": 10000.0,
        "eagle_aux_hidden_state_layer_ids": AUX,
        **config,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(
        {k: v.contiguous() for k, v in _eagle3_tensors(seed, vocab).items()},
        str(folder / "model.safetensors"),
    )
    return str(folder)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny 4-layer Llama target (with a tokenizer) and a random EAGLE-3 head for it."""
    from tests.test_loader import tiny_hf_tokenizer, tiny_model

    root = tmp_path_factory.mktemp("heads")
    target = root / "target"
    model = tiny_model("llama", seed=0, layers=4)
    model.save_pretrained(target)
    tiny_hf_tokenizer().save_pretrained(target)
    return {"target": str(target), "eagle3": write_eagle3(root / "eagle3"), "hf": model}


def _llm(saved, spec=None, **kw):
    from foveal.engine.llm import LLM

    opts = dict(dtype="float32", num_blocks=200, block_size=4, max_num_seqs=8, max_model_len=160)
    return LLM(saved["target"], speculative_config=spec, **{**opts, **kw})


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, VOCAB, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    eng = llm.engine
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished()
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


def test_eagle3_greedy_is_lossless_in_mixed_batches(saved):
    prompts = _prompts(6, seed=1)
    plain = _run(_llm(saved, max_num_batched_tokens=12), prompts, MIXED_GREEDY)
    spec = {"method": "eagle3", "model": saved["eagle3"], "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(saved, spec, max_num_batched_tokens=12)  # chunked prompts: partial catch-ups
    assert _run(llm, prompts, MIXED_GREEDY) == plain
    st = llm.engine.speculation.stats
    assert st.num_drafts > 0 and st.num_draft_tokens >= 3 * st.num_drafts // 2
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0  # the head's pool is idle too


def test_eagle3_method_is_read_from_the_checkpoint(saved):
    from foveal.config import SpeculativeConfig

    assert SpeculativeConfig.parse({"model": saved["eagle3"]}).method == "eagle3"
    assert SpeculativeConfig.parse({"model": saved["target"]}).method == "draft_model"


def test_eagle3_head_that_does_not_fit_is_refused(saved, tmp_path):
    bad_vocab = write_eagle3(tmp_path / "v", vocab_size=VOCAB + 8)
    with pytest.raises(ValueError, match="vocabulary of 1008; the target's is 1000"):
        _llm(saved, {"method": "eagle3", "model": bad_vocab})
    bad_layers = write_eagle3(tmp_path / "l", eagle_aux_hidden_state_layer_ids=[1, 2, 7])
    with pytest.raises(ValueError, match="three distinct target layers"):
        _llm(saved, {"method": "eagle3", "model": bad_layers})
    bad_hidden = write_eagle3(tmp_path / "h", target_hidden_size=2 * H)
    with pytest.raises(ValueError, match="hidden states of size 128; the target's are 64"):
        _llm(saved, {"method": "eagle3", "model": bad_hidden})


def _proposals(llm, prompts) -> list[tuple[list[int], list[int]]]:
    """(the row's tokens, its drafts) of every proposal staged for a verify step while the prompts run
    greedily (drafted fresh by propose_device, or behind the verify step before by the head's follow)."""
    eng = llm.engine
    seen = []
    real = eng.runner.stage_drafts  # where the engine puts every proposal: the drafts stay on the device

    def recording(request_ids, counts, flat):
        drafts = split_drafts(flat.tolist(), counts)
        seen.extend((list(eng.scheduler.get(r).all_token_ids), d) for r, d in zip(request_ids, drafts))
        return real(request_ids, counts, flat)

    eng.runner.stage_drafts = recording
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    return seen


# -- the drafts against a dense reference -----------------------------------------------------------
def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float32) / HD)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _attention(t, p, src, pos, theta=10000.0, *, causal=True, bias=False, qk_norm=False, queries=None):
    """Dense GQA attention of layer `p` over the rows `src` at positions `pos`, o_proj applied; causal,
    or (causal False) every row sees every row; `queries`: only the last rows ask."""
    n = src.shape[0]

    def proj(name, heads):
        y = src @ t[p + f"self_attn.{name}_proj.weight"].T
        return (y + t[p + f"self_attn.{name}_proj.bias"] if bias else y).view(n, heads, HD)

    q, k, v = proj("q", HEADS), proj("k", KV), proj("v", KV)
    if qk_norm:
        q, k = _rms(q, t[p + "self_attn.q_norm.weight"]), _rms(k, t[p + "self_attn.k_norm.weight"])
    q, k = _rope(q, pos, theta)[n - (queries or n) :], _rope(k, pos, theta)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5
    if causal:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(q.shape[0], HEADS * HD)
    return a @ t[p + "self_attn.o_proj.weight"].T


def _mlp(t, p, y):
    gate, up = y @ t[p + "mlp.gate_proj.weight"].T, y @ t[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T


def _chain(step, ids: list[int], hidden, k: int) -> list[int]:
    """k greedy drafts: step(ids, hidden) -> (draft, the last row's output state); each draft is
    appended with that state (the next position's pair) and everything recomputed."""
    out = []
    for _ in range(k):
        d, h = step(ids, hidden)
        out.append(d)
        ids, hidden = ids + [d], torch.cat([hidden, h])
    return out


def _eagle3_reference(t, hf, tokens: list[int], k: int) -> list[int]:
    """k greedy drafts after `tokens`: the target's hidden states from transformers, fused by fc, paired
    with the next token, through the EAGLE-3 layer over the whole sequence (causal, dense)."""
    p, embed = "midlayer.", hf.model.embed_tokens.weight

    def step(ids, hidden):
        x = torch.cat(
            [_rms(embed[ids], t[p + "input_layernorm.weight"]), _rms(hidden, t[p + "hidden_norm.weight"])], -1
        )
        r = _attention(t, p, x, torch.arange(len(ids))) + hidden
        o = _mlp(t, p, _rms(r, t[p + "post_attention_layernorm.weight"])) + r
        d = int((_rms(o, t["norm.weight"])[-1] @ t["lm_head.weight"].T).argmax())
        return d + int(t["d2t"][d]), o[-1:]

    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[i][0] for i in AUX], -1) @ t["fc.weight"].T
        return _chain(step, list(tokens[1:]), fused[:-1], k)


@pytest.mark.parametrize("graphs", [False, True])
def test_eagle3_drafts_equal_a_dense_reference_of_the_head(saved, graphs):
    """Every propose() of a real run (prefill chunks, several requests, drafts rejected and kept) gives
    what the dense reference computes from transformers' hidden states of the same tokens; also with
    the head's steps through its graphs' static buffers (run eagerly on a CPU)."""
    t = _eagle3_tensors(0)
    spec = {"method": "eagle3", "model": saved["eagle3"], "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(saved, spec, max_num_batched_tokens=10)
    if graphs:
        # a catch-up of more than 16 positions runs as a chunk
        llm.engine.speculation.proposer.use_graphs(4, 200)
    seen = _proposals(llm, _prompts(3, seed=2))
    assert len(seen) > 10
    if graphs:
        # the steps went through the static buffers
        assert llm.engine.speculation.proposer.graphs.input_ids.any()
    for tokens, drafts in seen:
        assert drafts == _eagle3_reference(t, saved["hf"], tokens, len(drafts)), tokens


def test_runner_reports_the_hidden_states_of_confirmed_rows(saved):
    """With n-gram drafts accepted and rejected, the rows the runner reports per request, joined by
    position, are transformers' hidden states entering layer 2 of the final sequence."""

    class Tap:
        tap_layers = (2,)

        @staticmethod
        def fuse(aux, final):
            return aux[0]

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
             "adaptive": False}  # fmt: skip
    llm = _llm(saved, ngram, max_num_batched_tokens=10)
    eng = llm.engine
    eng.runner.tap = Tap()
    if eng.runner.graphs is not None:  # graphs captured without a tap (CUDA) have nowhere to keep rows
        if eng.runner.graphs.emulated:
            eng.runner.graphs.tap = eng.runner.tap
        else:
            eng.runner.graphs = None
    got: dict[str, dict[int, torch.Tensor]] = {}

    def observe(states):
        for rid, (start, h) in states.items():
            for j in range(h.shape[0]):
                got.setdefault(rid, {})[start + j] = h[j].clone()

    eng.speculation.proposer.observe_hidden = observe
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11] * 6]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert (
        eng.speculation.stats.num_accepted_tokens > 0
        and eng.speculation.stats.num_accepted_tokens < eng.speculation.stats.num_draft_tokens
    )
    for o, p in zip(outs, prompts):
        seq = p + o.outputs[0].token_ids
        rows = got[o.request_id]
        assert sorted(rows) == list(
            range(len(seq) - 1)
        )  # every fed position, once the token after it is known
        with torch.no_grad():
            want = saved["hf"](torch.tensor([seq[:-1]]), output_hidden_states=True).hidden_states[2][0]
        torch.testing.assert_close(
            torch.stack([rows[i] for i in range(len(seq) - 1)]).cpu(), want, atol=1e-4, rtol=1e-4
        )


# -- MTP (MiMo: a Qwen2 decoder with its own next-token layer) --------------------------------------
def _mtp_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    p = "model.mtp_layers.0."
    return {
        p + "token_layernorm.weight": 1 + w(H),
        p + "hidden_layernorm.weight": 1 + w(H),
        p + "input_proj.weight": w(H, 2 * H),
        p + "input_layernorm.weight": 1 + w(H),
        p + "self_attn.q_proj.weight": w(HEADS * HD, H),
        p + "self_attn.q_proj.bias": w(HEADS * HD),
        p + "self_attn.k_proj.weight": w(KV * HD, H),
        p + "self_attn.k_proj.bias": w(KV * HD),
        p + "self_attn.v_proj.weight": w(KV * HD, H),
        p + "self_attn.v_proj.bias": w(KV * HD),
        p + "self_attn.o_proj.weight": w(H, HEADS * HD),
        p + "post_attention_layernorm.weight": 1 + w(H),
        p + "mlp.gate_proj.weight": w(INTER, H),
        p + "mlp.up_proj.weight": w(INTER, H),
        p + "mlp.down_proj.weight": w(H, INTER),
        p + "final_layernorm.weight": 1 + w(H),
    }


def make_mimo(folder, model, tokenizer) -> str:
    """A tiny MiMo checkpoint as published from a transformers Qwen2 model (hidden 64, 4/2 heads of 16):
    its config with model_type mimo and num_nextn_predict_layers, the MTP layer's tensors in the same
    safetensors file."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1,
               auto_map={"AutoConfig": "configuration_mimo.MiMoConfig"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(_mtp_tensors(3))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module")
def mimo(tmp_path_factory):
    from tests.test_loader import tiny_hf_tokenizer, tiny_model

    model = tiny_model("qwen2", seed=3, layers=2)
    return {"target": make_mimo(tmp_path_factory.mktemp("mimo"), model, tiny_hf_tokenizer()), "hf": model}


def test_mtp_greedy_is_lossless_in_mixed_batches(mimo):
    prompts = _prompts(6, seed=3)
    plain = _run(_llm(mimo, max_num_batched_tokens=12), prompts, MIXED_GREEDY)  # MTP weights are skipped
    llm = _llm(
        mimo, {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}, max_num_batched_tokens=12
    )
    assert _run(llm, prompts, MIXED_GREEDY) == plain
    assert llm.engine.speculation.stats.num_drafts > 0
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0


def _mtp_reference(t, hf, tokens: list[int], k: int) -> list[int]:
    """k greedy MTP drafts: the layer over (the target's last normed hidden state h_i, x_{i+1}) pairs,
    causal, dense; each draft appends (the layer's output, the draft) and recomputes."""
    p = "model.mtp_layers.0."
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    theta = hf.config.rope_parameters["rope_theta"]

    def step(ids, hidden):
        pos = torch.arange(len(ids))
        e = embed[ids] * (pos != 0)[:, None]
        x = torch.cat(
            [_rms(hidden, t[p + "hidden_layernorm.weight"]), _rms(e, t[p + "token_layernorm.weight"])], -1
        )
        x = x @ t[p + "input_proj.weight"].T
        r = _attention(t, p, _rms(x, t[p + "input_layernorm.weight"]), pos, theta, bias=True) + x
        o = _rms(
            _mlp(t, p, _rms(r, t[p + "post_attention_layernorm.weight"])) + r, t[p + "final_layernorm.weight"]
        )
        return int((o[-1] @ head.T).argmax()), o[-1:]

    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        return _chain(step, list(tokens[1:]), states[:-1], k)


@pytest.mark.parametrize("graphs", [False, True])
def test_mtp_drafts_equal_a_dense_reference_of_the_layer(mimo, graphs):
    t = _mtp_tensors(3)
    llm = _llm(
        mimo, {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}, max_num_batched_tokens=10
    )
    if graphs:
        llm.engine.speculation.proposer.use_graphs(16, 200)
    seen = _proposals(llm, _prompts(3, seed=4))
    assert len(seen) > 10
    if graphs:
        # the steps went through the static buffers
        assert llm.engine.speculation.proposer.graphs.input_ids.any()
    for tokens, drafts in seen:
        assert drafts == _mtp_reference(t, mimo["hf"], tokens, len(drafts)), tokens


def test_mtp_needs_mtp_layers(saved):
    with pytest.raises(ValueError, match="has no MTP layers"):
        _llm(saved, {"method": "mtp"})


# -- DFlash (a block-diffusion drafter over the target's layer outputs) ------------------------------
DF_LAYERS, DF_BLOCK, DF_TARGET = 2, 4, [1, 3]  # layer 3: the target's last output; MASK: the last id


def _dflash_tensors(seed: int, num_features: int = len(DF_TARGET)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=g) * scale

    t = {
        "fc.weight": w(H, num_features * H, scale=0.1),
        "hidden_norm.weight": 1 + w(H),
        "norm.weight": 1 + w(H),
    }
    for i in range(DF_LAYERS):
        p = f"layers.{i}."
        t.update({
            p + "input_layernorm.weight": 1 + w(H),
            p + "post_attention_layernorm.weight": 1 + w(H),
            p + "self_attn.q_proj.weight": w(HEADS * HD, H),
            p + "self_attn.k_proj.weight": w(KV * HD, H),
            p + "self_attn.v_proj.weight": w(KV * HD, H),
            p + "self_attn.o_proj.weight": w(H, HEADS * HD),
            p + "self_attn.q_norm.weight": 1 + w(HD),
            p + "self_attn.k_norm.weight": 1 + w(HD),
            p + "mlp.gate_proj.weight": w(INTER, H),
            p + "mlp.up_proj.weight": w(INTER, H),
            p + "mlp.down_proj.weight": w(H, INTER),
        })  # fmt: skip
    return t


def write_dflash(
    folder, seed: int = 0, vocab: int = VOCAB, target_layers=DF_TARGET, num_target_layers=4
) -> str:
    """A random DFlash drafter in z-lab's layout (a Qwen3 config, no embedding or LM head)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
        "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD,
        "num_hidden_layers": DF_LAYERS, "rms_norm_eps": 1e-5, "vocab_size": vocab,
        "max_position_embeddings": 256, "rope_theta": 1000.0, "block_size": DF_BLOCK,
        "num_target_layers": num_target_layers,
        "dflash_config": {"mask_token_id": vocab - 1, "target_layer_ids": target_layers},
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(_dflash_tensors(seed, len(target_layers)), str(folder / "model.safetensors"))
    return str(folder)


def test_dflash_greedy_is_lossless_in_mixed_batches(saved, tmp_path):
    path = write_dflash(tmp_path / "dflash")
    prompts = _prompts(6, seed=6)
    plain = _run(_llm(saved, max_num_batched_tokens=12), prompts, MIXED_GREEDY)
    llm = _llm(
        saved, {"model": path, "num_speculative_tokens": 3, "adaptive": False}, max_num_batched_tokens=12
    )
    assert llm.engine.config.speculative.method == "dflash"  # read from the checkpoint
    assert _run(llm, prompts, MIXED_GREEDY) == plain
    assert llm.engine.speculation.stats.num_draft_tokens >= 2 * llm.engine.speculation.stats.num_drafts
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0


def _dflash_reference(t, hf, tokens: list[int], k: int) -> list[int]:
    """The block's drafts, dense: context features of every token but the last (their target states
    after layers 1 and 3), the block [last token, MASK...] attending to all context and to itself."""
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        n = len(tokens)
        # HF's last entry is after the final norm: the last layer's raw output is the input of the norm
        outs = [states[i + 1][0] if i + 1 < len(states) - 1 else None for i in DF_TARGET]
        if outs[-1] is None:
            captured = {}
            hook = hf.model.norm.register_forward_hook(lambda m, a, o: captured.update(x=a[0][0]))
            hf(torch.tensor([tokens]))
            hook.remove()
            outs[-1] = captured["x"]
        feats = _rms(torch.cat(outs, -1)[: n - 1] @ t["fc.weight"].T, t["hidden_norm.weight"])
        embed = hf.model.embed_tokens.weight
        x = embed[[tokens[-1]] + [VOCAB - 1] * (DF_BLOCK - 1)]
        pos = torch.arange(n - 1 + DF_BLOCK)
        for i in range(DF_LAYERS):  # no mask: every context key, the block both ways
            p = f"layers.{i}."
            src = torch.cat([feats, _rms(x, t[p + "input_layernorm.weight"])])
            x = x + _attention(t, p, src, pos, 1000.0, causal=False, qk_norm=True, queries=DF_BLOCK)
            x = x + _mlp(t, p, _rms(x, t[p + "post_attention_layernorm.weight"]))
        logits = _rms(x, t["norm.weight"]) @ hf.lm_head.weight.T
    return logits[1 : 1 + k].argmax(-1).tolist()


@pytest.mark.parametrize(
    "graphs,grouped", [(False, False), (True, False), (True, True)], ids=["eager", "graphs", "graphs-grouped"]
)
def test_dflash_drafts_equal_a_dense_reference_of_the_block(saved, tmp_path, graphs, grouped, monkeypatch):
    """Every staged proposal (drafted fresh, or behind the verify step before it at every accepted
    count) equals the dense reference. grouped: the Triton backend (the interpreter on a CPU: ~30 s)
    reads a request's keys once for its catch-up and block rows (from 4 keys on), through the graphs'
    variant with that kernel, and eagerly where a step does not fit them."""
    t = _dflash_tensors(0)
    path = write_dflash(tmp_path / "dflash")
    kw = dict(attention_backend="triton", request_rows_min_tokens=4, shared_prefix_min_rows=0)
    spec = {"model": path, "num_speculative_tokens": 3, "adaptive": False}
    llm = _llm(saved, spec, max_num_batched_tokens=10, **(kw if grouped else {}))
    launches = []
    if grouped:
        from foveal.attention.kernels import decode

        llm.engine.runner.backend.request_min_groups = 1  # steps of any size (the default: 32 requests)
        real = decode.shared_prefix_attention
        monkeypatch.setattr(decode, "shared_prefix_attention", lambda *a: launches.append(1) or real(*a))
    if graphs:  # the static-buffer path (eager on a CPU); a long context (a prompt) runs without it
        llm.engine.speculation.proposer.use_graphs(2, 200)
        replay = llm.engine.speculation.proposer.graphs.replay
        llm.engine.speculation.proposer.graphs.replay = (
            lambda batch, n, lora=False, shared=False, moved=None: (
                launches.append("graph") if shared else None,
                replay(batch, n, lora, shared, moved),
            )[1]
        )
    _forced_acceptance(monkeypatch)  # every accepted count: the blocks drafted behind verify steps move
    seen = _proposals(llm, _prompts(2 if grouped else 3, seed=7))  # (the interpreter: fewer when grouped)
    assert len(seen) > 6
    assert bool(launches) == grouped and ("graph" in launches) == (grouped and graphs)
    if graphs:
        # the block steps went through the graphs
        assert llm.engine.speculation.proposer.graphs.input_ids.any()
    for tokens, drafts in seen:
        assert drafts == _dflash_reference(t, saved["hf"], tokens, len(drafts)), tokens


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_prompt_chunks_are_fed_to_the_head_as_their_steps_launch(saved, tmp_path, method):
    """A prompt chunk's states go to the head when its step is launched (its tokens are known), so no
    proposal catches up more than a verify step adds (1 + k positions a row), however long the prompt
    and its chunks; the drafts stay those of a head fed all at once (the dense-reference tests)."""
    head = write_eagle3(tmp_path / "e") if method == "eagle3" else write_dflash(tmp_path / "d")
    llm = _llm(saved, {"method": method, "model": head, "num_speculative_tokens": 3, "adaptive": False},
               max_num_batched_tokens=10)  # fmt: skip
    proposer = llm.engine.speculation.proposer
    spans = {"prefeed": [], "propose": []}
    where = ["prefeed"]
    catch_up, propose = proposer._catch_up, proposer.propose_device

    def caught(row, extra, min_new):
        c = catch_up(row, extra, min_new)
        if c is not None:
            spans[where[0]].append(c[2] - c[1] + 1)
        return c

    def proposing(rows):
        where[0] = "propose"
        try:
            return propose(rows)
        finally:
            where[0] = "prefeed"

    proposer._catch_up, proposer.propose_device = caught, proposing
    prompts = [p * 2 for p in _prompts(3, seed=4)]  # 8-58 tokens: several chunks of up to 10
    outs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # every prompt position but the last (its pair needs the first output token) was fed as it launched
    assert max(spans["prefeed"]) >= 9 and sum(spans["prefeed"]) == sum(len(p) - 1 for p in prompts)
    assert spans["propose"] and max(spans["propose"]) <= 1 + 3
    plain = _run(_llm(saved), prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert outs == plain


def _forced_acceptance(monkeypatch) -> None:
    """Verify steps keep (i + step) % (k_i + 1) of item i's drafts, then the target's greedy token: every
    accepted count 0 .. k occurs (a random head's drafts would all be rejected), the tokens each row
    emits are what greedy verification would emit had those drafts been the target's."""
    from foveal.worker import model_runner

    steps = [0]

    def forced(logits, draft_ids, num_drafts, *args):
        steps[0] += 1
        k = torch.tensor(num_drafts)
        item = torch.repeat_interleave(torch.arange(len(num_drafts)), k + 1)
        offset = torch.arange(len(item)) - ((k + 1).cumsum(0) - (k + 1))[item]
        accepted = (torch.arange(len(num_drafts)) + steps[0]) % (k + 1)
        tokens = torch.where(offset < accepted[item], draft_ids.long().cpu(), logits.argmax(-1).cpu())
        return tokens.to(logits.device), accepted.to(logits.device)

    monkeypatch.setattr(model_runner, "verify", forced)


@pytest.mark.parametrize(
    "method,graphs,adaptive",
    [("eagle3", False, False), ("eagle3", True, False), ("dflash", False, False), ("dflash", True, False),
     ("eagle3", True, True)],
    ids=["eagle3-eager", "eagle3-graphs", "dflash-eager", "dflash-graphs", "eagle3-graphs-adaptive"],
)  # fmt: skip
def test_a_head_drafts_behind_each_verify_step(saved, tmp_path, method, graphs, adaptive, monkeypatch):
    """After a request's first proposal, each one is drafted behind the verify step before it, from
    that step's tokens and accepted counts on the device (`follow`; through the graphs, the accepted
    count moves the chain's or the block's positions, lengths and slots there): propose() catches up
    each request once, and with every accepted count from 0 to k the drafts are the dense reference's
    of the head; the head's KV pool is empty after. With the load-aware policy (its probes and rests,
    k per row) a proposal drafted behind a verify step is taken only where still current."""
    _forced_acceptance(monkeypatch)
    if method == "eagle3":
        t, head, reference = _eagle3_tensors(0), saved["eagle3"], _eagle3_reference
    else:
        t, head, reference = _dflash_tensors(0), write_dflash(tmp_path / "dflash"), _dflash_reference
    # the default token budget: every verify run fits (none loses its drafts to a prompt chunk)
    llm = _llm(saved, {"model": head, "num_speculative_tokens": 3, "adaptive": adaptive})
    proposer = llm.engine.speculation.proposer
    if graphs:
        proposer.use_graphs(4, 200)
    caught, followed, proposing = [], [], [False]
    catch_up, propose, follow = proposer._catch_up, proposer.propose_device, proposer.follow

    def catching(row, extra, min_new):
        c = catch_up(row, extra, min_new)
        if c is not None and proposing[0]:
            caught.append(row.request_id)
        return c

    def proposing_(rows):
        proposing[0] = True
        try:
            return propose(rows)
        finally:
            proposing[0] = False

    def following(runs, *args):
        follow(runs, *args)
        followed.append(len(proposer._ready[1]) if proposer._ready else 0)

    proposer._catch_up, proposer.propose_device, proposer.follow = catching, proposing_, following
    prompts = _prompts(4, seed=5)
    seen = _proposals(llm, prompts)
    stats = llm.engine.speculation.stats
    if adaptive:  # some rows rested or drafted fewer: follow()'s drafts were taken where current
        assert stats.num_drafts > len(caught) >= len(prompts) and sum(followed) > 0
    else:
        assert sorted(caught) == sorted(set(caught)) and len(caught) == len(prompts)
        # every verify run but each request's first took follow()'s drafts (its last is followed too)
        assert stats.num_drafts == len(caught) + sum(followed) - len(prompts) >= 3 * len(prompts)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert proposer.kv.num_used_blocks == 0 and not proposer._seqs
    if graphs:
        assert proposer.graphs.input_ids.any()
    for tokens, drafts in seen:
        assert drafts == reference(t, saved["hf"], tokens, len(drafts)), tokens


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_prefix_cache_hit_drafts_from_what_the_target_computed(saved, tmp_path, method):
    """The second run of a prompt takes its prefix from the cache, so the head never sees those
    positions' states: it drafts from the first state it gets (output still equals plain greedy)."""
    head = write_eagle3(tmp_path / "e") if method == "eagle3" else write_dflash(tmp_path / "d")
    llm = _llm(saved, {"method": method, "model": head, "num_speculative_tokens": 3, "adaptive": False})
    prompt = _prompts(1, seed=9)[0] * 3
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (miss,) = llm.generate([prompt], params)
    drafted, cached = llm.engine.speculation.stats.num_draft_tokens, llm.engine.kv.hit_tokens
    (hit,) = llm.generate([prompt], params)
    assert cached == 0 and llm.engine.kv.hit_tokens >= 12  # the second run's prefix came from the cache
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    assert llm.engine.speculation.stats.num_draft_tokens - drafted >= 3 * 4  # it drafted on most steps
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_a_vision_language_target_with_a_head_is_lossless(tmp_path, method):
    """A tiny LLaVA target (its language model taps the states; image rows included) with a random
    head: greedy output of prompts with 0, 1 and 2 images equals plain greedy."""
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import build, image

    tiny = build("llava", str(tmp_path / "llava"))
    vocab = len(tiny.processor.tokenizer)
    if method == "eagle3":
        head = write_eagle3(tmp_path / "h", vocab=vocab, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    else:
        head = write_dflash(tmp_path / "h", vocab=vocab, target_layers=[0, 1], num_target_layers=2)
    im = tiny.image_text
    cases = [
        ("<|user|>Say something.\n<|assistant|>", []),
        (f"<|user|>{im}What is this?\n<|assistant|>", [image(40, 30, 1)]),
        (f"<|user|>Compare {im} with {im}.\n<|assistant|>", [image(56, 56, 2), image(28, 70, 3)]),
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for spec in (None, {"method": method, "model": head, "num_speculative_tokens": 3, "adaptive": False}):
        llm = LLM(tiny.path, dtype="float32", num_blocks=256, block_size=4, speculative_config=spec)
        prompts = [llm.processor.render_prompt(t, images=i) for t, i in cases]
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]
    assert llm.engine.speculation.stats.num_drafts > 0


def test_n_sequences_with_a_head(saved):
    """n = 3 seeded samples per prompt with EAGLE-3 drafting: the same outputs on a second engine (each
    sequence drafted from its own states), three different sequences, and greedy n = 2 equal to plain."""
    spec = {"method": "eagle3", "model": saved["eagle3"], "num_speculative_tokens": 3, "adaptive": False}
    prompts = _prompts(2, seed=11)
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    runs = [
        [[o.token_ids for o in r.outputs] for r in _llm(saved, spec).generate(prompts, sampled)]
        for _ in range(2)
    ]
    assert runs[0] == runs[1] and all(len({tuple(t) for t in seqs}) == 3 for seqs in runs[0])
    greedy = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    plain = [[o.token_ids for o in r.outputs] for r in _llm(saved).generate(prompts, greedy)]
    llm = _llm(saved, spec)
    assert [[o.token_ids for o in r.outputs] for r in llm.generate(prompts, greedy)] == plain
    speculation = llm.engine.speculation
    assert speculation.stats.num_drafts > 0 and speculation.proposer.kv.num_used_blocks == 0


def test_train_eagle3_steps_are_the_heads_chain(saved):
    """scripts/train_eagle3.py trains with EAGLE-3's training-time test; its step s at position
    last + s - 1 (the drafts fed back as tokens) must be the engine's s-th draft, so what it trains is
    what the engine drafts with."""
    from types import SimpleNamespace

    from scripts.train_eagle3 import Head

    t, hf = _eagle3_tensors(0), saved["hf"]
    cfg = SimpleNamespace(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=KV,
        head_dim=HD, rms_norm_eps=1e-5, rope_theta=10000.0,
    )  # fmt: skip
    target_ids = t["d2t"] + torch.arange(DRAFT_VOCAB)
    head = Head(cfg, DRAFT_VOCAB, hf.model.embed_tokens.weight.detach(), t["norm.weight"], target_ids)
    head.load_tensors(t)
    spec = {"method": "eagle3", "model": saved["eagle3"], "num_speculative_tokens": 3, "adaptive": False}
    seen = _proposals(_llm(saved, spec), _prompts(3, seed=4))
    assert len(seen) > 10
    with torch.no_grad():
        for tokens, drafts in seen:
            ids = torch.tensor(tokens + drafts[:-1])
            states = hf(ids[None], output_hidden_states=True).hidden_states
            outs = head(torch.cat([states[i][0] for i in AUX], -1), ids, len(drafts))
            last = len(tokens) - 2
            got = [int(target_ids[logits[last + s].argmax()]) for s, (logits, _) in enumerate(outs)]
            assert got == drafts, tokens
