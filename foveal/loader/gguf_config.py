"""GGUF metadata -> a transformers config, for the GGUF architectures we serve: llama (Mixtral too: a
llama with experts), qwen2, qwen3, qwen3moe.

Owns: reading metadata values from a parsed header (gguf_file.py), the per-architecture table (config class,
HF architecture name, whether llama.cpp permuted q/k), and the rope parameters, including Llama 3
scaling rebuilt from llama.cpp's `rope_freqs` tensor. It must not open files (the caller owns the
one reader) and must not read tensor data beyond that small rope vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from foveal.loader.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class GGUFArch:
    config_class: str  # name in `transformers`
    hf_architecture: str
    permuted_qk: bool  # llama.cpp's converter reorders q/k rows for its rope layout (llama only)
    has_qkv_bias: bool | None = None  # fixed by the family (qwen2); None: read from the tensors


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaConfig", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArch("Qwen2Config", "Qwen2ForCausalLM", permuted_qk=False, has_qkv_bias=True),
    "qwen3": GGUFArch("Qwen3Config", "Qwen3ForCausalLM", permuted_qk=False),
    "qwen3moe": GGUFArch("Qwen3MoeConfig", "Qwen3MoeForCausalLM", permuted_qk=False),
}

_MISSING = object()
# llama.cpp writes no metadata for Llama 3 rope scaling, only per-frequency factors computed with
# these defaults (its converter reads no other values), so we rebuild the HF dict and verify it.
_LLAMA3_LOW_FREQ_FACTOR = 1.0
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_LLAMA3_ORIGINAL_CONTEXT = 8192


def meta(reader, key: str, default: Any = _MISSING, *, path: str = "") -> Any:
    """One metadata value as a Python scalar/str/list; `default` when absent (ModelLoadError if none)."""
    value = reader.metadata.get(key, _MISSING)
    if value is _MISSING:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF file {path} lacks the metadata key {key!r}")
        return default
    return value


def gguf_architecture(reader, path: str) -> GGUFArch:
    name = meta(reader, "general.architecture", path=path)
    if name not in GGUF_ARCHS:
        raise ModelLoadError(
            f"GGUF file {path} has architecture {name!r}; supported GGUF architectures: "
            f"{', '.join(GGUF_ARCHS)} (for other models pass a Hugging Face folder or repo with safetensors)"
        )
    return GGUF_ARCHS[name]


def build_hf_config(reader, path: str):
    """The transformers config (LlamaConfig / Qwen2Config / Qwen3Config) described by the metadata."""
    import transformers

    spec = gguf_architecture(reader, path)
    arch = meta(reader, "general.architecture", path=path)
    tensors = {t.name: t for t in reader.tensors}

    def m(key: str, default: Any = _MISSING) -> Any:
        return meta(reader, f"{arch}.{key}", default, path=path)

    hidden = int(m("embedding_length"))
    heads = int(m("attention.head_count"))
    kv_heads = _scalar(m("attention.head_count_kv", heads), "attention.head_count_kv", path)
    head_dim = int(m("attention.key_length", hidden // heads))
    rope_dim = m("rope.dimension_count", None)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ModelLoadError(
            f"GGUF file {path}: rope.dimension_count {rope_dim} != head_dim {head_dim} (partial rotary "
            "embeddings are not supported)"
        )
    vocab = m("vocab_size", None)
    if vocab is None:  # older converters: the embedding's ggml shape is [hidden, vocab]
        if "token_embd.weight" not in tensors:
            raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")
        vocab = int(tensors["token_embd.weight"].shape[1])

    moe: dict[str, Any] = {}
    config_class, hf_architecture = spec.config_class, spec.hf_architecture
    if arch == "llama" and m("expert_count", None):  # Mixtral: llama.cpp writes it as llama with experts
        config_class, hf_architecture = "MixtralConfig", "MixtralForCausalLM"
        moe = dict(
            num_local_experts=int(m("expert_count")),
            num_experts_per_tok=int(m("expert_used_count")),
            sliding_window=None,
        )
    if arch == "qwen3moe":  # every layer sparse; llama.cpp renormalizes the top k (expert_weights_norm)
        moe = dict(
            num_experts=int(m("expert_count")),
            num_experts_per_tok=int(m("expert_used_count")),
            moe_intermediate_size=int(m("expert_feed_forward_length")),
            norm_topk_prob=bool(m("expert_weights_norm", True)),
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(m("feed_forward_length", moe.get("moe_intermediate_size", _MISSING))),
        num_hidden_layers=int(m("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(m("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters=_rope_parameters(reader, arch, head_dim, path),
        tie_word_embeddings="output.weight" not in tensors,
        architectures=[hf_architecture],
        **moe,
    )
    ctx = m("context_length", None)
    if ctx is not None:
        kwargs["max_position_embeddings"] = int(ctx)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta(reader, f"tokenizer.ggml.{name}_token_id", None)
        if value is not None:
            kwargs[key] = int(value)
    if spec.has_qkv_bias is None:
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        kwargs["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    return getattr(transformers, config_class)(**kwargs)


def _scalar(value: Any, key: str, path: str) -> int:
    if isinstance(value, list):  # per-layer values; we serve only uniform models
        if len(set(value)) != 1:
            raise ModelLoadError(f"GGUF file {path}: per-layer {key} {value} is not supported")
        value = value[0]
    return int(value)


def _rope_parameters(reader, arch: str, head_dim: int, path: str) -> dict[str, Any]:
    theta = float(meta(reader, f"{arch}.rope.freq_base", 10000.0))  # llama.cpp's default base
    kind = meta(reader, f"{arch}.rope.scaling.type", "none")
    factor = meta(reader, f"{arch}.rope.scaling.factor", None)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        if kind not in ("none", "llama3"):
            raise ModelLoadError(f"GGUF file {path} has both rope_freqs and rope scaling type {kind!r}")
        return _llama3_from_rope_freqs(np.asarray(rope_freqs.data, dtype=np.float64), theta, head_dim, path)
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return {"rope_type": "default", "rope_theta": theta}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(factor)}
    if kind == "yarn":
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": float(factor or 1.0)}
        orig = meta(reader, f"{arch}.rope.scaling.original_context_length", None)
        if orig is not None:
            params["original_max_position_embeddings"] = int(orig)
        return params
    raise ModelLoadError(f"GGUF file {path}: rope scaling type {kind!r} is not supported")


def llama3_rope_factors(
    theta: float, dim: int, factor: float, low: float, high: float, orig: int
) -> np.ndarray:
    """llama.cpp's per-frequency wavelength multipliers for Llama 3 rope scaling (its rope_freqs)."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    smooth = (orig / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, mid))


def _llama3_from_rope_freqs(factors: np.ndarray, theta: float, head_dim: int, path: str) -> dict[str, Any]:
    factor = float(factors.max())
    low, high, orig = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR, _LLAMA3_ORIGINAL_CONTEXT
    expected = llama3_rope_factors(theta, head_dim, factor, low, high, orig)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4, atol=1e-6):
        raise ModelLoadError(
            f"GGUF file {path}: its rope_freqs tensor does not match Llama 3 rope scaling with "
            f"factor={factor}, low_freq_factor={low}, high_freq_factor={high}, original context {orig}"
        )
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": orig,
    }
