"""The Gemma 3 text decoder on the paged KV cache (`Gemma3ForCausalLM`, and the decoder inside the
Gemma 3 VLM). What sets it apart from the Llama family:

- RMSNorm scales by (1 + w), all in fp32 before the cast back; q and k are RMS-normed per head;
- four norms per layer: around attention (input, post-attention) and around the MLP (pre, post);
- the MLP is gated GELU (tanh approximation); embeddings are scaled by sqrt(hidden), the scale rounded
  to the model dtype first (as transformers does: sqrt(3072) becomes 55.5 in bf16);
- attention scale is query_pre_attn_scalar ** -0.5, not head_dim ** -0.5;
- layers are `sliding_attention` (window `sliding_window`, local RoPE base) or `full_attention`
  (global RoPE, possibly scaled), per `config.layer_types`; the window is the attention backend's job;
- optional logit softcaps, both None in real Gemma 3 configs: on attention scores
  (`attn_logit_softcapping`; transformers' Gemma 3 ignores it, Gemma 2 applies it) and on the final
  logits (`final_logit_softcapping`; transformers 5.x applies it in Gemma3ForCausalLM only, not in the
  VLM; we apply it in both, as the 4.x VLM did).

RoPE per layer type comes from the 5.x `rope_parameters` dict keyed by layer type, or the 4.x fields
(`rope_theta` + `rope_scaling` for global layers, `rope_local_base_freq` for local ones). cos/sin are
computed per step from the inverse frequencies, as transformers does, instead of held in a table
(Gemma 3 contexts reach 128k positions with head_dim 256).
"""

from __future__ import annotations

from collections.abc import Iterable
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from foveal.layers.embedding import Embedding
from foveal.layers.linear import Linear, linear
from foveal.layers.rotary import apply_rotary, inv_frequencies, rope_parameters
from foveal.models.base import CausalLM, StepContext
from foveal.models.llama import DecoderShape
from foveal.models.weights import ParamFiller, decoder_param

SLIDING, FULL = "sliding_attention", "full_attention"
_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32; the checkpoint stores w centred on 0."""

    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def layer_types(config) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    # early 4.x configs: every `sliding_window_pattern`-th layer is global
    pattern = int(
        getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    )
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


def layer_rope_parameters(config, layer_type: str) -> dict:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if layer_type == SLIDING:
        theta = getattr(config, "rope_local_base_freq", None) or 10000.0
        return {"rope_type": "default", "rope_theta": float(theta)}
    return rope_parameters(config)


class GemmaRotary:
    """Inverse frequencies per layer type (fp32, outside the module tree so dtype casts leave them
    alone); `cos_sin` gives each type's [T, 1, head_dim] cos/sin for a step."""

    def __init__(self, config, head_dim: int, types: list[str]):
        self.inv = {}
        for t in sorted(set(types)):
            params = layer_rope_parameters(config, t)
            self.inv[t] = inv_frequencies(SimpleNamespace(rope_parameters=params), head_dim)

    def to_device(self, device) -> GemmaRotary:
        self.inv = {t: inv.to(device) for t, inv in self.inv.items()}
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
        out = {}
        for t, inv in self.inv.items():
            freqs = positions.float()[:, None] * inv[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            out[t] = emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)
        return out


class Gemma3Spec(DecoderShape):
    """The architecture numbers of one Gemma 3 text config (read defensively: 4.x and 5.x configs)."""

    def __init__(self, config):
        super().__init__(config)
        self.bias = bool(getattr(config, "attention_bias", False))
        self.tie_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.window = getattr(config, "sliding_window", None)
        self.layer_types = layer_types(config)
        self.attn_softcap = getattr(config, "attn_logit_softcapping", None)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"hidden_activation {act!r} is not supported ({', '.join(_ACTS)})")
        self.act = act
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (an embedding model) is not supported")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"layer types {sorted(set(self.layer_types))} are not supported")


class Attention(nn.Module):
    def __init__(self, spec: Gemma3Spec, layer_type: str, backend):
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.layer_type = layer_type
        self.window = spec.window if layer_type == SLIDING else None
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden, self.q_size + 2 * self.kv_size, bias=spec.bias)
        self.o_proj = Linear(self.q_size, spec.hidden, bias=spec.bias)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.eps)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.eps)

    def forward(self, x, rope, kv_cache, meta, lora=None):
        s = self.spec
        q, k, v = self.qkv_proj(x, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(-1, s.num_heads, s.head_dim))
        k = self.k_norm(k.view(-1, s.num_kv_heads, s.head_dim))
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        cos, sin = rope[self.layer_type]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(
            q, k, v, kv_cache, meta, s.scale, window=self.window, softcap=s.attn_softcap
        )
        return self.o_proj(out.reshape(-1, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, spec: Gemma3Spec):
        super().__init__()
        self.inter = spec.intermediate
        self.act = _ACTS[spec.act]
        self.gate_up_proj = Linear(spec.hidden, 2 * spec.intermediate, bias=False)
        self.down_proj = Linear(spec.intermediate, spec.hidden, bias=False)

    def forward(self, x, lora=None):
        gate, up = self.gate_up_proj(x, lora).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, spec: Gemma3Spec, layer_type: str, backend):
        super().__init__()
        self.self_attn = Attention(spec, layer_type, backend)
        self.mlp = MLP(spec)
        self.input_layernorm = GemmaRMSNorm(spec.hidden, spec.eps)
        self.post_attention_layernorm = GemmaRMSNorm(spec.hidden, spec.eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(spec.hidden, spec.eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(spec.hidden, spec.eps)

    def forward(self, x, rope, kv_cache, meta, lora=None):
        h = self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, lora)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x), lora)
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(CausalLM):
    implements_sliding_window = True  # the backend masks windows: max_context need not cap the context

    def __init__(self, config, backend, max_positions: int):
        super().__init__()
        self.config = config
        spec = self.spec = Gemma3Spec(config)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(DecoderLayer(spec, t, backend) for t in spec.layer_types)
        self.norm = GemmaRMSNorm(spec.hidden, spec.eps)
        self.lm_head = None if spec.tie_embeddings else Linear(spec.hidden, spec.vocab_size, bias=False)
        self.rotary = GemmaRotary(config, spec.head_dim, spec.layer_types)
        self._embed_scale: dict[torch.dtype, float] = {}

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        return self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        scale = self._embed_scale.get(x.dtype)
        if scale is None:  # sqrt(hidden) rounded to the model dtype, as the reference multiplies by it
            scale = self._embed_scale[x.dtype] = float(torch.tensor(self.spec.hidden**0.5).to(x.dtype))
        return x * scale

    def forward(self, input_ids, ctx: StepContext) -> torch.Tensor:
        x = self.embed_input_ids(input_ids) if ctx.inputs_embeds is None else ctx.inputs_embeds
        rope = self.rotary.cos_sin(ctx.positions, x.dtype)
        for layer, cache in zip(self.layers, ctx.kv_caches):
            x = layer(x, rope, cache, ctx.attn, ctx.lora)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight)
        cap = self.spec.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def reset_buffers(self, device, dtype=None) -> None:
        self.rotary = GemmaRotary(self.config, self.spec.head_dim, self.spec.layer_types).to_device(device)

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        filler = ParamFiller(self)
        for name, tensor in weights:
            self.load_weight(filler, name, tensor)
        filler.check_complete()

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        """One HF-named tensor; `prefix` is where this model sits inside a larger one (the VLM)."""
        if "rotary_emb" in name or name.endswith("embed_scale"):
            return
        target, offset, rows = decoder_param(name, self.spec, tied=self.lm_head is None)
        if target is not None:
            filler.put(prefix + target, tensor, name, offset, rows)
