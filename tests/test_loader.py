"""foveal.loader against references: transformers' own GGUF loader on the embedded model, tiny random
HF models saved with save_pretrained, and tiny GGUFs written the way llama.cpp's converter writes them
(names from gguf's TensorNameMap, q/k permuted for llama). Plus every failure -> ModelLoadError."""

from __future__ import annotations

import math
import os
import shutil
import time

import numpy as np
import pytest
import torch

from foveal.config import ENV_CACHE_DIR
from foveal.loader import ModelLoadError, load_checkpoint, read_gguf_weights
from foveal.loader.gguf_tokenizer import load_gguf_tokenizer, tokenizer_cache_dir
from tests.gguf_blocks import WRITERS
from tests.tiny import fp8_blocks

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello there! What is 2+2?"},
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("Ġ", "t"), ("Ġt", "he")]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FAMILIES = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", autouse=True)
def cache_dir(tmp_path_factory):
    """Converted tokenizers go to a temporary cache, never to ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        d = tmp_path_factory.mktemp("foveal-cache")
        mp.setenv(ENV_CACHE_DIR, str(d))
        yield d


# -- the embedded model against transformers -------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_ckpt(cache_dir):
    ckpt = load_checkpoint(None, dtype=torch.float32)
    return ckpt, dict(ckpt.weights)


@pytest.mark.slow
def test_default_gguf_weights_match_transformers(smollm_ckpt, hf_smollm):
    ckpt, ours = smollm_ckpt
    ref = hf_smollm.state_dict()
    assert ckpt.format == "gguf" and ckpt.name == "SmolLM2-135M-Instruct" and os.path.isfile(ckpt.source)
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: the embedding serves as the head
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ref[name].shape, name
        if not torch.equal(tensor, ref[name]):  # exact is expected; 1e-6 is the contract
            torch.testing.assert_close(tensor, ref[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_default_gguf_config_matches_transformers(smollm_ckpt, hf_smollm):
    ours, ref = smollm_ckpt[0].hf_config, hf_smollm.config
    assert ours.architectures == ["LlamaForCausalLM"] and ours.model_type == ref.model_type
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(ours, key) == getattr(ref, key), key
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.rope_parameters["rope_type"] == "default"


@pytest.mark.slow
def test_default_gguf_tokenizer(smollm_ckpt, smollm_tokenizer, smollm_path, monkeypatch):
    tok = smollm_ckpt[0].tokenizer
    assert tok.chat_template and tok.chat_template == smollm_tokenizer.chat_template
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert list(ids) == list(
        smollm_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    )
    assert tok.encode("Hello, world!") == smollm_tokenizer.encode("Hello, world!")
    # second load comes from the cache: transformers is never asked to convert the GGUF again
    assert os.path.isfile(os.path.join(tokenizer_cache_dir(smollm_path), "tokenizer.json"))
    from transformers import AutoTokenizer

    calls = []
    orig = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: (calls.append(k), orig(*a, **k))[1])
    cached = load_gguf_tokenizer(smollm_path)
    assert calls and not any("gguf_file" in k for k in calls)
    assert cached.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True) == ids


# -- tiny HF folders -------------------------------------------------------------------------------
def tiny_hf_tokenizer():
    """A byte-level BPE tokenizer built in code (no download): 256 bytes, 3 merges, 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_vocab()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]


def tiny_model(family: str, tie: bool = False, seed: int = 0, layers: int = 2):
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    moe = {}
    if family == "qwen3_moe":  # 4 experts of 32, top 2
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    config = getattr(transformers, f"{cls}Config")(
        **moe,
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0 + seed},
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomize so a mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_()
    return model


def expected_state(model) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_yields_state_dict(tmp_path, family, sharded):
    model = tiny_model(family, tie=family == "qwen2")
    folder = tmp_path / f"tiny-{family}"
    model.save_pretrained(folder, max_shard_size="100KB" if sharded else "1GB")
    tiny_hf_tokenizer().save_pretrained(folder)
    assert os.path.isfile(folder / "model.safetensors.index.json") == sharded
    ref = expected_state(model)
    for dtype in (torch.float32, torch.bfloat16):
        ckpt = load_checkpoint(str(folder), dtype=dtype, device=torch.device("cpu"), progress=sharded)
        assert (ckpt.format, ckpt.name, ckpt.source) == ("safetensors", f"tiny-{family}", str(folder))
        assert ckpt.hf_config.architectures == [type(model).__name__]
        assert ckpt.hf_config.model_type == family
        got = dict(ckpt.weights)
        assert set(got) == set(ref)
        for name, tensor in got.items():
            assert tensor.dtype == dtype and tensor.device.type == "cpu", name
            assert torch.equal(tensor, ref[name].to(dtype)), name
        tok = ckpt.tokenizer
        assert tok.chat_template == CHAT_TEMPLATE
        assert tok.apply_chat_template(CHAT, tokenize=True) == tiny_hf_tokenizer().apply_chat_template(
            CHAT, tokenize=True
        )


# -- FP8 checkpoints (Qwen3-*-FP8, DeepSeek's layout) ----------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_an_fp8_checkpoint_loads_dequantized(tmp_path, family):
    """Block-wise FP8 weights with their weight_scale_inv (blocks of 24 x 40: partial ones at the edges):
    every linear comes dequantized, exactly q * scale, the rest as stored, or with keep_fp8 (the
    default) an expert's weight as stored with its scales; the scales are not tensors of the model;
    another quantization method is refused by name."""
    import json

    from safetensors.torch import save_file

    model = tiny_model(family, seed=3)
    folder = tmp_path / "fp8"
    model.config.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    block = (24, 40)
    state, want = {}, {}
    for name, t in expected_state(model).items():
        if t.dim() == 3:  # transformers 5's fused experts: the published layout has one tensor per expert
            continue
        if t.dim() == 2 and name.endswith("proj.weight"):
            state[name], state[name + "_scale_inv"], want[name] = fp8_blocks(t.float(), block)
        else:
            state[name] = want[name] = t
    if family == "qwen3_moe":  # per-expert tensors, each quantized on its own
        for name, t in expected_state(model).items():
            if t.dim() != 3:
                continue
            prefix, stack = name.rsplit(".", 1)
            for e in range(t.shape[0]):
                parts = (
                    [("down_proj", t[e])]
                    if stack == "down_proj"
                    else list(zip(("gate_proj", "up_proj"), t[e].chunk(2, dim=0)))
                )
                for proj, w in parts:
                    n = f"{prefix}.{e}.{proj}.weight"
                    state[n], state[n + "_scale_inv"], want[n] = fp8_blocks(w.float().contiguous(), block)
    save_file({n: t.contiguous() for n, t in state.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg))
    ckpt = load_checkpoint(str(folder), dtype=torch.float32, device=torch.device("cpu"), keep_fp8=False)
    got = dict(ckpt.weights)
    assert set(got) == set(want) and not any(n.endswith("_scale_inv") for n in got)
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
    # kept (the default): an expert's tensors come as stored with their scales, the rest as before
    kept = dict(load_checkpoint(str(folder), dtype=torch.float32, device=torch.device("cpu")).weights)
    assert set(kept) == set(want)
    experts = {n for n in kept if ".mlp.experts." in n}
    assert (len(experts) > 0) == (family == "qwen3_moe")
    for name, tensor in kept.items():
        if name in experts:
            assert tensor.dtype == torch.float8_e4m3fn and tensor.fp8_block == block
            assert torch.equal(tensor, state[name]) and torch.equal(
                tensor.fp8_scale_inv, state[name + "_scale_inv"]
            )
        else:
            assert torch.equal(tensor, want[name]), name
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="awq"):
        load_checkpoint(str(folder), dtype=torch.float32, device=torch.device("cpu"))


# -- tiny GGUFs written like llama.cpp writes them -------------------------------------------------
def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied to q with (n_head, n_head), k with n_head_kv."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path,
    arch: str,
    model=None,
    *,
    tokenizer: bool = True,
    vocab_meta: bool = True,
    extra_tensors: dict[str, np.ndarray] | None = None,
    quantize: dict[str, str] | None = None,
) -> None:
    """`quantize`: llama.cpp tensor-name part (e.g. "ffn_up_exps") -> GGUF type, stored quantized. A
    mixture of experts' transformers stacks become llama.cpp's ffn_{gate,up,down}_exps [E, rows, cols]
    and its router ffn_gate_inp."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    if model is not None:
        c = model.config
        w.add_block_count(c.num_hidden_layers)
        w.add_context_length(c.max_position_embeddings)
        w.add_embedding_length(c.hidden_size)
        w.add_feed_forward_length(c.intermediate_size)
        w.add_head_count(c.num_attention_heads)
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        if arch == "llama":
            w.add_rope_dimension_count(c.head_dim)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        if vocab_meta:
            w.add_vocab_size(c.vocab_size)
        experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
        if experts:
            w.add_expert_count(experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            if hasattr(c, "moe_intermediate_size"):
                w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        vocab = tiny_vocab()
        w.add_token_list(vocab)
        w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
        w.add_token_merges([" ".join(m) for m in MERGES])
        w.add_bos_token_id(vocab.index("<|im_start|>"))
        w.add_eos_token_id(vocab.index("<|im_end|>"))
        w.add_chat_template(CHAT_TEMPLATE)
    if model is not None:
        c = model.config
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
        tensors = {}
        for hf_name, t in expected_state(model).items():
            layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
            if hf_name.endswith("mlp.experts.gate_up_proj"):
                stack = t.detach().float().numpy()
                gate, up = stack.reshape(t.shape[0], 2, -1, t.shape[2]).swapaxes(0, 1)
                tensors[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                tensors[f"blk.{layer}.ffn_up_exps.weight"] = up
                continue
            if hf_name.endswith("mlp.experts.down_proj"):
                tensors[f"blk.{layer}.ffn_down_exps.weight"] = t.detach().float().numpy()
                continue
            if hf_name.endswith("mlp.gate.weight"):
                tensors[f"blk.{layer}.ffn_gate_inp.weight"] = t.detach().float().numpy()
                continue
            base, suffix = hf_name.rsplit(".", 1)
            a = t.detach().numpy().astype(np.float32)
            if arch == "llama" and base.endswith("q_proj"):
                a = llamacpp_permute(a, c.num_attention_heads, c.num_attention_heads)
            elif arch == "llama" and base.endswith("k_proj"):
                a = llamacpp_permute(a, c.num_attention_heads, c.num_key_value_heads)
            tensors[f"{names.get_name(base)}.{suffix}"] = a
        for name, a in tensors.items():
            kind = next((k for part, k in (quantize or {}).items() if f".{part}." in f".{name}"), None)
            a = np.ascontiguousarray(a, dtype=np.float32)
            if kind is None:
                w.add_tensor(name, a)
            else:  # K-quants: our writers (gguf-py reads them but writes none)
                qtype = gguf.GGMLQuantizationType[kind]
                q = WRITERS[kind](a) if kind in WRITERS else gguf.quants.quantize(a, qtype)
                w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
    for name, a in (extra_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_gguf_roundtrip(tmp_path, family, tie):
    model = tiny_model(family, tie=tie, seed=1)
    path = tmp_path / f"tiny-{family}.gguf"
    write_gguf(path, family, model, vocab_meta=not tie)
    ckpt = load_checkpoint(str(path), dtype=torch.float32, progress=True)
    assert (ckpt.format, ckpt.name) == ("gguf", f"tiny-{family}")
    ref = expected_state(model)
    got = dict(ckpt.weights)
    assert set(got) == set(ref)
    for name, tensor in got.items():
        assert torch.equal(tensor, ref[name]), name
    cfg, rc = ckpt.hf_config, model.config
    assert type(cfg) is type(rc) and cfg.architectures == [type(model).__name__]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
    ):
        assert getattr(cfg, key) == getattr(rc, key), key
    assert cfg.rms_norm_eps == pytest.approx(rc.rms_norm_eps)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": rc.rope_parameters["rope_theta"]}
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    tok = ckpt.tokenizer
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.decode(tok.encode("the cat")) == "the cat"
    # bf16 on the lower-level path too
    _, weights = read_gguf_weights(str(path), dtype=torch.bfloat16)
    for name, tensor in weights:
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, ref[name].to(torch.bfloat16)), name


def test_gguf_unreadable_tokenizer_cache_is_rebuilt(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen2", tiny_model("qwen2"))
    first = load_checkpoint(str(path), dtype=torch.float32).tokenizer
    cached = tokenizer_cache_dir(str(path))
    with open(os.path.join(cached, "tokenizer.json"), "w") as f:
        f.write("{not json")
    again = load_checkpoint(str(path), dtype=torch.float32).tokenizer
    assert again.encode("the cat") == first.encode("the cat") and again.chat_template == CHAT_TEMPLATE
    with open(os.path.join(cached, "tokenizer.json")) as f:
        assert f.read(1) == "{" and len(f.read()) > 100  # rewritten


def test_gguf_llama3_rope_scaling_from_rope_freqs(tmp_path):
    model = tiny_model("llama")
    c = model.config
    c.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    c.head_dim = 64  # enough frequencies to span all three llama3 bands
    c.num_attention_heads, c.num_key_value_heads = 1, 1
    model = type(model)(c)
    # what convert_hf_to_gguf.py computes for rope_scaling {"rope_type": "llama3", "factor": 8.0, ...}
    factor, low, high, old = 8.0, 1.0, 4.0, 8192
    factors = []
    for i in range(0, c.head_dim, 2):
        wavelen = 2 * math.pi * 500000.0 ** (i / c.head_dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    assert factors[0] == 1.0 and factors[-1] == factor and any(1.0 < f < factor for f in factors)
    path = tmp_path / "llama3.gguf"
    write_gguf(
        path,
        "llama",
        model,
        tokenizer=False,
        extra_tensors={"rope_freqs.weight": np.array(factors, dtype=np.float32)},
    )
    cfg, weights = read_gguf_weights(str(path))
    assert cfg.rope_parameters == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in dict(weights)


# -- failures ----------------------------------------------------------------------------------------
def expect_error(model, *fragments, **kwargs):
    t0 = time.perf_counter()
    with pytest.raises(ModelLoadError) as info:
        ckpt = load_checkpoint(model, dtype=torch.float32, **kwargs)
        dict(ckpt.weights)
    assert time.perf_counter() - t0 < 30, "a failing load must fail fast"
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, msg
    return info.value


def test_missing_path(tmp_path):
    expect_error(str(tmp_path / "nope"), "does not exist", "nope")
    expect_error(str(tmp_path / "nope.gguf"), "does not exist")
    expect_error("./models/nope", "does not exist")


def test_truncated_gguf(tmp_path, smollm_path):
    path = tmp_path / "cut.gguf"
    with open(smollm_path, "rb") as src, open(path, "wb") as dst:
        dst.write(src.read(1 << 20))
    err = expect_error(str(path), str(path), "truncated")
    assert err.__cause__ is not None


def test_truncated_tiny_gguf_tensor_data(tmp_path):
    full = tmp_path / "full.gguf"
    write_gguf(full, "qwen2", tiny_model("qwen2"), tokenizer=False)
    cut = tmp_path / "cut.gguf"
    with open(full, "rb") as f:
        data = f.read()
    cut.write_bytes(data[: len(data) - 5000])
    expect_error(str(cut), str(cut))


def test_garbage_safetensors(tmp_path):
    folder = tmp_path / "garbage"
    tiny_model("llama").config.save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(os.urandom(4096))
    err = expect_error(str(folder), "model.safetensors", "corrupt")
    assert err.__cause__ is not None


def test_truncated_safetensors(tmp_path):
    folder = tmp_path / "cut"
    tiny_model("llama").save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    st = folder / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-1000])
    expect_error(str(folder), "model.safetensors")


def test_folder_without_config_or_weights(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(__file__, empty / "x.gguf")  # not a real GGUF: only the hint is checked
    expect_error(str(empty), "no config.json", "x.gguf")
    no_weights = tmp_path / "no-weights"
    tiny_model("qwen3").config.save_pretrained(no_weights)
    expect_error(str(no_weights), "no safetensors weights")
    sharded = tmp_path / "sharded"
    tiny_model("qwen3").save_pretrained(sharded, max_shard_size="100KB")
    tiny_hf_tokenizer().save_pretrained(sharded)
    victim = sorted(sharded.glob("model-*.safetensors"))[-1]
    victim.unlink()
    expect_error(str(sharded), victim.name, "missing")


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(
        path, "gpt2", tokenizer=False, extra_tensors={"token_embd.weight": np.zeros((8, 4), np.float32)}
    )
    expect_error(str(path), "'gpt2'", "llama", "qwen2", "qwen3")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 64)
    expect_error(str(path), "not a GGUF")


def test_hub_id_offline(monkeypatch):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)
    expect_error(
        "foveal-test-nobody/no-such-model-7f3a", "foveal-test-nobody/no-such-model-7f3a", "HF_HUB_OFFLINE"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_weights_land_on_cuda(tmp_path, device):
    model = tiny_model("qwen3")
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="100KB")
    tiny_hf_tokenizer().save_pretrained(folder)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, "qwen3", model)
    ref = expected_state(model)
    for source in (folder, path):
        got = dict(load_checkpoint(str(source), dtype=torch.bfloat16, device=device).weights)
        assert set(got) == set(ref), source
        for name, tensor in got.items():
            assert tensor.device.type == "cuda" and tensor.dtype == torch.bfloat16, name
            assert torch.equal(tensor.cpu(), ref[name].to(torch.bfloat16)), name
