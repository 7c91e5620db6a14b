"""Decoder-only Llama-family models on the paged KV cache: Llama 2/3.x, SmolLM2, Mistral (no sliding
window), Qwen2/Qwen2.5 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm); and the diffusion LMs built on
them, LLaDA (Llama, renamed tensors) and SDAR (Qwen3), whose masks the attention spans carry. The
differences are config switches, not copies.

Tokens of all sequences in a step are flattened to [T]; the attention backend knows which token
belongs to which sequence. q/k/v and gate/up projections are fused into one matmul each.
Models never look at requests: they see token ids, positions and attention metadata.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from foveal.layers import cpu_fused, fused
from foveal.layers.embedding import Embedding
from foveal.layers.linear import Linear, linear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import RotaryEmbedding, apply_rotary_qk
from foveal.models.base import CausalLM, StepContext
from foveal.models.weights import ParamFiller, decoder_param


class DecoderShape:
    """The sizes every decoder family reads the same way from a transformers config."""

    def __init__(self, config):
        self.hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        self.intermediate = config.intermediate_size
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.eps = config.rms_norm_eps


class DecoderSwitches(DecoderShape):
    """The architecture switches of one Llama-family model, read from a transformers config."""

    def __init__(self, config, *, family_qkv_bias: bool, qk_norm: bool):
        super().__init__(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_bias = family_qkv_bias or attention_bias  # Qwen2 always has q/k/v bias, never o bias
        self.o_bias = attention_bias and not family_qkv_bias
        self.mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.qk_norm = qk_norm
        self.tie_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")


class Attention(nn.Module):
    def __init__(self, spec: DecoderSwitches, backend, in_features: int | None = None):
        super().__init__()
        self.window: int | None = None  # a sliding window (gpt-oss's sliding layers), else full attention
        self.sinks: torch.Tensor | None = None  # per-head attention-sink logits (gpt-oss), else None
        self.spec = spec
        self.backend = backend
        h, hd = spec.num_heads, spec.head_dim
        self.q_size, self.kv_size = h * hd, spec.num_kv_heads * hd
        # in_features: an EAGLE-3 draft layer reads [token embedding, hidden state] (2 x hidden)
        self.qkv_proj = Linear(in_features or spec.hidden, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(hd, spec.eps)
            self.k_norm = RMSNorm(hd, spec.eps)
        self.scale = hd**-0.5

    def forward(self, x, cos, sin, kv_cache, meta, lora=None):
        s = self.spec
        qkv = self.qkv_proj(x, lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, s.num_heads, s.head_dim)
        k = k.view(-1, s.num_kv_heads, s.head_dim)
        v = v.view(-1, s.num_kv_heads, s.head_dim)
        norms = (self.q_norm, self.k_norm) if s.qk_norm else None
        q, k = apply_rotary_qk(q, k, cos, sin, norms)  # on CUDA: in place, into the qkv buffer
        if self.window is None and self.sinks is None:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self.backend.forward(
                q, k, v, kv_cache, meta, self.scale, window=self.window, sinks=self.sinks
            )
        return self.o_proj(out.reshape(-1, self.q_size), lora)


class MLP(nn.Module):
    def __init__(self, spec: DecoderSwitches):
        super().__init__()
        self.inter = spec.intermediate
        self.gate_up_proj = Linear(spec.hidden, 2 * spec.intermediate, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate, spec.hidden, bias=spec.mlp_bias)

    def forward(self, x, lora=None):
        gate_up = self.gate_up_proj(x, lora)
        if gate_up.is_cuda and fused.use_fused(gate_up):
            return self.down_proj(fused.silu_and_mul(gate_up), lora)
        if cpu_fused.use(gate_up) and (h := cpu_fused.silu_and_mul(gate_up)) is not None:
            return self.down_proj(h, lora)
        gate, up = gate_up.split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(
        self, spec: DecoderSwitches, backend, mlp: nn.Module | None = None, attn: nn.Module | None = None
    ):
        super().__init__()
        self.self_attn = Attention(spec, backend) if attn is None else attn
        self.mlp = MLP(spec) if mlp is None else mlp  # or a mixture of experts (models/llama_moe.py)
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta, lora=None):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_residual(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm.forward_residual(h, residual)
        return self.mlp(h, lora), residual


class LlamaForCausalLM(CausalLM):
    qkv_bias = False
    qk_norm = False
    supports_aux_hidden = True

    def __init__(self, config, backend, max_positions: int):
        super().__init__()
        self.config = config
        spec = self.spec = self._spec(config)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden)
        self.layers = nn.ModuleList(self._layer(spec, backend, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.rotary = RotaryEmbedding(config, spec.head_dim, max_positions)
        self.lm_head = None if spec.tie_embeddings else Linear(spec.hidden, spec.vocab_size, bias=False)

    def _spec(self, config) -> DecoderSwitches:
        return DecoderSwitches(config, family_qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    def _layer(self, spec: DecoderSwitches, backend, index: int) -> DecoderLayer:
        return DecoderLayer(spec, backend)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim): what the KV pool must hold per token."""
        return self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim

    def forward(self, input_ids, ctx: StepContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if ctx.inputs_embeds is None else ctx.inputs_embeds
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        residual, deepstack, aux = None, ctx.deepstack, ctx.aux_layers
        for i, (layer, cache) in enumerate(zip(self.layers, ctx.kv_caches)):
            if i in aux:  # the hidden state entering layer i: the running sum x + residual
                ctx.aux.append(x if residual is None else x + residual)
            x, residual = layer(x, residual, cos, sin, cache, ctx.attn, ctx.lora)
            if deepstack is not None and i < deepstack[1].shape[1]:
                # the layer's output is x + residual; adding to x puts it on that sum
                x = x.index_add(0, deepstack[0], deepstack[1][:, i].to(x.dtype))
        if len(self.layers) in aux:  # the last layer's output, before the final norm
            ctx.aux.append(x + residual)
        x, _ = self.norm.forward_residual(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight)

    # -- weights ---------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; every parameter must be filled."""
        filler = ParamFiller(self)
        for name, tensor in weights:
            self.load_weight(filler, name, tensor)
        filler.check_complete()

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        """One HF-named tensor; `prefix` is where this model sits inside a larger one (a VLM)."""
        if "rotary_emb" in name:
            return
        target, offset, rows = self._map_name(name)
        if target is not None:
            filler.put(prefix + target, tensor, name, offset, rows)

    def reset_buffers(self, device, dtype=None) -> None:
        """Recompute non-persistent buffers after the model was materialized from the meta device."""
        self.rotary = RotaryEmbedding(self.config, self.spec.head_dim, self.rotary.cos.shape[0]).to(device)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def _map_name(self, name: str):
        return decoder_param(name, self.spec, tied=self.lm_head is None)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class MiMoForCausalLM(Qwen2ForCausalLM):
    """Xiaomi MiMo: a Qwen2 decoder. Its MTP layers (model.mtp_layers.*) are the mtp drafter's
    (foveal/speculative/mtp.py), loaded from the same checkpoint when speculating."""

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        if not name.removeprefix("model.").startswith("mtp_layers."):
            super().load_weight(filler, name, tensor, prefix)


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class _EmbeddingDecoder:
    """transformers' bare decoder (an embedding model's published class, e.g. Qwen3-Embedding's
    Qwen3Model): the same layers without an LM head; tensors named without the `model.` prefix. Its
    prompts' last-token hidden states are the embeddings (foveal/server/protocols/embeddings.py)."""

    default_pooling = "last"

    def _spec(self, config) -> DecoderSwitches:
        spec = super()._spec(config)
        spec.tie_embeddings = True  # no head of its own (compute_logits only ever sees no rows)
        return spec


class LlamaModel(_EmbeddingDecoder, LlamaForCausalLM):
    pass


class Qwen2Model(_EmbeddingDecoder, Qwen2ForCausalLM):
    pass


class Qwen3Model(_EmbeddingDecoder, Qwen3ForCausalLM):
    pass


class SDARForCausalLM(Qwen3ForCausalLM):
    """SDAR (JetLM/SDAR-*-Chat): block diffusion on a Qwen3 decoder with Qwen3's tensor names. Only the
    attention differs (block-causal: see foveal/diffusion/info.py), which the runner's spans carry."""


# LLaDA's tensor names (under model.transformer.) -> ours (HF Llama's, under model.)
_LLADA_BLOCK = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_LLADA_TOP = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}


def llada_tensor_name(name: str) -> str:
    """LLaDA checkpoint name -> the HF Llama name of the same tensor (other names pass unchanged):

    model.transformer.wte.weight                  -> model.embed_tokens.weight
    model.transformer.blocks.3.attn_out.weight    -> model.layers.3.self_attn.o_proj.weight
    model.transformer.ln_f.weight                 -> model.norm.weight
    model.transformer.ff_out.weight               -> lm_head.weight  (the untied head)"""
    parts = name.split(".")
    if parts[:2] != ["model", "transformer"] or len(parts) < 4:
        return name
    if parts[2] == "blocks" and len(parts) >= 6 and parts[4] in _LLADA_BLOCK:
        return ".".join(["model.layers", parts[3], _LLADA_BLOCK[parts[4]], *parts[5:]])
    if parts[2] in _LLADA_TOP:
        return ".".join([_LLADA_TOP[parts[2]], *parts[3:]])
    return name


class LLaDAModelLM(LlamaForCausalLM):
    """LLaDA-8B (GSAI-ML/LLaDA-8B-*): masked diffusion on a Llama decoder, every token attending to
    every token. Its config.json is renamed into a LlamaConfig by the loader (`llada_config`); its
    tensors are renamed here (`llada_tensor_name`)."""

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        super().load_weight(filler, llada_tensor_name(name), tensor, prefix)
