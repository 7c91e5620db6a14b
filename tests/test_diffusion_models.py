"""Diffusion LMs loaded from their published checkpoint layouts (tests/diffusion_models.py writes tiny
random ones): LLaDA (masked diffusion, Llama decoder under OLMo-style names) and SDAR (block diffusion,
Qwen3). They load through the normal path, and one forward of our model, with the diffusion mask given
to the torch attention backend as bidirectional spans, equals transformers' model given the same mask
as a 4-D additive attention mask:

    LLaDA  one span over the whole sequence                    every token sees every token
    SDAR   spans [k*bs, (k+1)*bs)                              q sees k iff q // bs >= k // bs
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from foveal.attention import get_backend
from foveal.attention.base import AttentionBatch
from foveal.diffusion.info import DiffusionInfo, diffusion_info
from foveal.loader import ModelLoadError, load_checkpoint
from foveal.models import build_model
from foveal.models.base import StepContext
from tests.diffusion_models import MASK_ID, VOCAB, hf_model, write_llada, write_sdar
from tests.diffusion_reference import block_causal_mask, forward_logits

BS = 4  # KV cache block size (not the diffusion block)


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return write_llada(tmp_path_factory.mktemp("llada"), seed=1)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return write_sdar(tmp_path_factory.mktemp("sdar"), seed=2, block_size=4)


def _ours(path: str):
    ckpt = load_checkpoint(path, dtype=torch.float32)
    cfg = ckpt.hf_config
    return build_model(
        cfg,
        get_backend("torch", "cpu"),
        max_positions=cfg.max_position_embeddings,
        dtype=torch.float32,
        device="cpu",
        weights=ckpt.weights,
    )


def _run(model, chunks) -> list[torch.Tensor]:
    """Feed steps of prefill chunks through our model on one paged cache; `chunks` is a list of steps,
    each a list of (sequence index, token ids, start position, bidirectional spans). Returns the logits
    of every fed token, per step."""
    layers, kvh, hd = model.kv_shape
    num_blocks = 64
    caches = [torch.zeros(2, num_blocks * BS, kvh, hd) for _ in range(layers)]
    tables = [list(range(1 + 16 * j, 1 + 16 * (j + 1))) for j in range(3)]  # block 0: the null block
    out = []
    for step in chunks:
        ids, pos, slots = [], [], []
        for seq, toks, start, _ in step:
            for i, t in enumerate(toks):
                p = start + i
                ids.append(t)
                pos.append(p)
                slots.append(tables[seq][p // BS] * BS + p % BS)
        batch = AttentionBatch(
            query_lens=[len(toks) for _, toks, _, _ in step],
            context_lens=[start for _, _, start, _ in step],
            block_tables=[tables[seq] for seq, _, _, _ in step],
            num_decodes=0,
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=BS,
            bidirectional=[list(spans) for *_, spans in step],
        )
        meta = model.layers[0].self_attn.backend.plan(batch, torch.device("cpu"))
        with torch.inference_mode():
            hidden = model(torch.tensor(ids), StepContext(torch.tensor(pos), caches, meta))
            out.append(model.compute_logits(hidden))
    return out


def _block_spans(start: int, end: int, bs: int) -> list[tuple[int, int]]:
    """The diffusion blocks a chunk [start, end) overlaps, as spans (the last one clipped to the chunk)."""
    return [(k * bs, min((k + 1) * bs, end)) for k in range(start // bs, (end + bs - 1) // bs)]


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n,), generator=g)
    ids[n // 2 :: 3] = MASK_ID  # a canvas: masks among the tokens, as the samplers feed it
    return ids.tolist()


# -- (a) the folders load through the normal path ---------------------------------------------------
def test_llada_loads_through_the_engine(llada):
    from foveal.engine.llm import LLM
    from foveal.models.llama import LLaDAModelLM

    llm = LLM(llada, dtype="float32", num_blocks=64, block_size=BS, max_num_seqs=4, max_model_len=256)
    model = llm.engine.model
    assert type(model) is LLaDAModelLM
    cfg = model.config
    assert (cfg.model_type, cfg.architectures) == ("llama", ["LLaDAModelLM"])
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (
        64, 4, 4, 2,
    )  # fmt: skip
    assert (cfg.intermediate_size, cfg.max_position_embeddings, cfg.vocab_size) == (128, 512, VOCAB)
    assert cfg.tie_word_embeddings is False and model.lm_head is not None
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.rms_norm_eps == 1e-5
    assert diffusion_info(cfg) == DiffusionInfo("masked", MASK_ID, 0)
    assert llm.tokenizer.convert_ids_to_tokens(MASK_ID) == "<|mdm_mask|>"


def test_sdar_loads_through_the_engine(sdar):
    from foveal.engine.llm import LLM
    from foveal.models.llama import SDARForCausalLM

    llm = LLM(sdar, dtype="float32", num_blocks=64, block_size=BS, max_num_seqs=4, max_model_len=256)
    model = llm.engine.model
    assert type(model) is SDARForCausalLM and model.spec.qk_norm
    assert model.config.model_type == "qwen3" and model.config.architectures == ["SDARForCausalLM"]
    assert diffusion_info(model.config) == DiffusionInfo("block", MASK_ID, 4)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_dummy_load_reads_the_published_config(tmp_path, family):
    """--load-format dummy on the config.json alone (no weights, no tokenizer) builds the same shape."""
    from foveal.engine.llm import LLM

    src = write_llada(tmp_path / "src") if family == "llada" else write_sdar(tmp_path / "src", block_size=8)
    cfg_file = tmp_path / "config.json"
    cfg_file.write_text(open(os.path.join(src, "config.json")).read())
    ckpt = load_checkpoint(str(cfg_file), dtype=torch.float32, load_format="dummy")
    assert ckpt.weights is None and ckpt.hf_config.hidden_size == 64 and ckpt.hf_config.vocab_size == VOCAB
    want = DiffusionInfo("masked", MASK_ID) if family == "llada" else DiffusionInfo("block", MASK_ID, 8)
    assert diffusion_info(ckpt.hf_config) == want
    llm = LLM(
        str(cfg_file), load_format="dummy", dtype="float32", num_blocks=64, block_size=BS, max_model_len=64
    )
    assert type(llm.engine.model).__name__ == ckpt.hf_config.architectures[0]


def test_llada_tied_and_biased_variants_load(tmp_path):
    """weight_tying (no model.transformer.ff_out) and include_bias (.bias tensors under the same names)."""
    from safetensors import safe_open

    path = write_llada(tmp_path / "v", seed=3, weight_tying=True, include_bias=True)
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.transformer.ff_out.weight" not in names
    assert "model.transformer.blocks.0.attn_out.bias" in names
    model = _ours(path)
    assert model.lm_head is None and model.spec.qkv_bias and model.spec.o_bias and model.spec.mlp_bias
    ids = _prompt(9, seed=3)
    got = _run(model, [[(0, ids, 0, [(0, len(ids))])]])[0]
    want = forward_logits(hf_model(path), ids, torch.ones(len(ids), len(ids), dtype=torch.bool))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_published_names_are_read(llada, sdar):
    ckpt = load_checkpoint(llada, dtype=torch.float32)
    names = [n for n, _ in ckpt.weights]
    assert "model.transformer.wte.weight" in names and "model.transformer.ff_out.weight" in names
    assert "model.transformer.blocks.1.ff_out.weight" in names and len(names) == 3 + 2 * 9
    ckpt = load_checkpoint(sdar, dtype=torch.float32)
    names = [n for n, _ in ckpt.weights]
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" in names


# -- (b) one forward equals transformers with the same mask -----------------------------------------
def test_llada_forward_is_bidirectional_and_equals_transformers(llada):
    model, hf = _ours(llada), hf_model(llada)
    a, b = _prompt(21, seed=4), _prompt(10, seed=5)
    # two sequences in one step, each one span over itself
    step = [(0, a, 0, [(0, len(a))]), (1, b, 0, [(0, len(b))])]
    got_a, got_b = _run(model, [step])[0].split([len(a), len(b)])
    for ids, got in ((a, got_a), (b, got_b)):
        full = torch.ones(len(ids), len(ids), dtype=torch.bool)
        want = forward_logits(hf, ids, full)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the comparison is not vacuous: causal attention gives other logits
        causal = forward_logits(hf, ids, torch.ones_like(full).tril())
        assert (causal - want).abs().max() > 0.1


def test_transformers_takes_the_4d_mask_as_given(llada):
    """The reference's premise: transformers 5 eager attention uses a 4-D float mask as it is, the
    causal mask not added on top. A causal one equals the plain model; one that splits the sequence in
    two bidirectional halves gives the second half's rows of that half run alone at its positions."""
    hf = hf_model(llada)
    ids = _prompt(12, seed=6)
    with torch.no_grad():
        plain = hf(input_ids=torch.tensor([ids])).logits[0]
        alone = hf(
            input_ids=torch.tensor([ids[6:]]),
            attention_mask=torch.zeros(1, 1, 6, 6),
            position_ids=torch.arange(6, 12)[None],
        ).logits[0]
    causal = forward_logits(hf, ids, torch.ones(12, 12, dtype=torch.bool).tril())
    torch.testing.assert_close(causal, plain, atol=1e-5, rtol=1e-5)
    half = torch.arange(12) // 6
    halves = forward_logits(hf, ids, half[:, None] == half[None, :])
    torch.testing.assert_close(halves[6:], alone, atol=1e-5, rtol=1e-5)
    assert (halves[:6] - plain[:6]).abs().max() > 0.1  # the first half saw its later tokens


@pytest.mark.parametrize("length", [11, 12, 3])
def test_sdar_forward_is_block_causal_and_equals_transformers(sdar, length):
    model, hf = _ours(sdar), hf_model(sdar)
    ids = _prompt(length, seed=length)
    want = forward_logits(hf, ids, block_causal_mask(length, 4))
    got = _run(model, [[(0, ids, 0, _block_spans(0, length, 4))]])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if length > 4:
        causal = forward_logits(hf, ids, torch.ones(length, length, dtype=torch.bool).tril())
        assert (causal - want).abs().max() > 0.1


def test_sdar_committed_blocks_then_a_block_over_the_cache(sdar):
    """Blocks prefilled in one step, the next block (partial) in a later step over their cached K/V:
    the same logits as one block-causal forward of the whole sequence (committed K/V are exact)."""
    model, hf = _ours(sdar), hf_model(sdar)
    ids = _prompt(15, seed=7)
    want = forward_logits(hf, ids, block_causal_mask(15, 4))
    steps = [[(0, ids[:8], 0, _block_spans(0, 8, 4))], [(0, ids[8:15], 8, _block_spans(8, 15, 4))]]
    got = torch.cat(_run(model, steps))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_sdar_larger_block(tmp_path):
    path = write_sdar(tmp_path / "bs8", seed=5, block_size=8)
    model, hf = _ours(path), hf_model(path)
    assert diffusion_info(model.config).block_size == 8
    ids = _prompt(19, seed=8)
    got = _run(model, [[(0, ids, 0, _block_spans(0, 19, 8))]])[0]
    torch.testing.assert_close(got, forward_logits(hf, ids, block_causal_mask(19, 8)), atol=1e-4, rtol=1e-4)


# -- (c) configs that cannot be served are refused --------------------------------------------------
def _edit_config(path: str, **changes) -> None:
    """Change config.json fields in place (None: remove the field)."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        cfg.pop(k) if v is None else cfg.__setitem__(k, v)
    with open(file, "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_diffusion_config_without_mask_token_is_refused(tmp_path, family):
    path = write_llada(tmp_path / "m") if family == "llada" else write_sdar(tmp_path / "m")
    _edit_config(path, mask_token_id=None)
    config = load_checkpoint(path, dtype=torch.float32).hf_config
    with pytest.raises(ValueError, match="no mask_token_id"):
        diffusion_info(config)


def test_diffusion_info_rules():
    from types import SimpleNamespace as NS

    assert diffusion_info(NS(architectures=["LlamaForCausalLM"])) is None
    assert diffusion_info(NS(architectures=None)) is None
    sdar = NS(architectures=["SDARForCausalLM"], mask_token_id=5, vocab_size=9)
    assert diffusion_info(sdar) == DiffusionInfo("block", 5, 4)
    with pytest.raises(ValueError, match="not a token id"):
        diffusion_info(NS(architectures=["LLaDAModelLM"], mask_token_id=9, vocab_size=9))
    with pytest.raises(ValueError, match="block_size"):
        diffusion_info(NS(architectures=["SDARForCausalLM"], mask_token_id=5, vocab_size=9, block_size=0))


@pytest.mark.parametrize(
    "override, message",
    [
        ({"block_type": "sequential"}, "block_type"),
        ({"attention_layer_norm": True}, "attention_layer_norm"),
        ({"alibi": True}, "alibi"),
        ({"include_qkv_bias": True}, "include_qkv_bias"),
        ({"mlp_hidden_size": None}, "mlp_hidden_size"),
    ],
)
def test_llada_switches_we_cannot_run_are_refused(tmp_path, override, message):
    path = write_llada(tmp_path / "x")
    _edit_config(path, **override)
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path, dtype=torch.float32)
