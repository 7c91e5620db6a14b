"""The EAGLE-3 draft head, in its published checkpoint layout (yuhuili/EAGLE3-*, the `speculators`
format): a config.json with the draft's sizes (a Llama config: hidden_size, heads, intermediate_size,
`draft_vocab_size`, optionally `target_hidden_size` and the target layers it reads,
`eagle_aux_hidden_state_layer_ids`), and safetensors

    fc.weight                      [H, 3 * target H]   fuses three target hidden states into one
    midlayer.* (or layers.0.*)     one decoder layer whose attention reads [embedding, hidden] (2H):
                                   input_layernorm (the embedding's), hidden_norm, self_attn, mlp,
                                   post_attention_layernorm
    norm.weight, lm_head.weight    the final norm and an LM head over the draft vocabulary
    d2t [draft vocab]              draft id -> target id offset (target = draft + d2t[draft])
    t2d, embed_tokens.weight       unused / optional (absent: the target's embedding is shared)

What the head computes at a position i, from the target's hidden states entering layers (2, L/2,
L - 3) at i, fused by fc into h_i, and the token x_{i+1} (see spec/hidden.py for the drafting loop):

    e = input_layernorm(embed(x_{i+1}))       r = h_i (norm_before_residual: hidden_norm(h_i))
    a = attn([e, hidden_norm(h_i)]) ; y, r = post_attention_layernorm(a + r) ; o = mlp(y) + r
    logits = lm_head(norm(o))  -> draft x_{i+2} (mapped by d2t) ; o is h for position i + 1
"""

from __future__ import annotations

import torch
from torch import nn

from foveal.layers.linear import Linear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import RotaryEmbedding
from foveal.models.base import StepContext
from foveal.models.llama import MLP, Attention, DecoderSwitches
from foveal.models.weights import ParamFiller, decoder_param
from foveal.speculative.hidden import DraftHead


def is_eagle3_config(config) -> bool:
    archs = " ".join(getattr(config, "architectures", None) or [])
    return "Eagle3" in archs or getattr(config, "speculators_model_type", None) == "eagle3"


def aux_layer_ids(config, target_layers: int) -> tuple[int, ...]:
    """The target layers whose input hidden states the head fuses: the checkpoint's own list, else
    EAGLE-3's default (2, L // 2, L - 3)."""
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
    # i: the state entering layer i (0: the embeddings; the target's layer count: its last output)
    if len(set(ids)) != 3 or ids != tuple(sorted(ids)) or not all(0 <= i <= target_layers for i in ids):
        raise ValueError(
            f"EAGLE-3 reads three distinct target layers, in order, inside 0..{target_layers} "
            f"(the target has {target_layers}); the draft names {list(ids)}"
        )
    return ids


class _Layer(nn.Module):
    def __init__(self, spec: DecoderSwitches, backend):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.hidden_norm = RMSNorm(spec.hidden, spec.eps)
        self.self_attn = Attention(spec, backend, in_features=2 * spec.hidden)
        self.post_attention_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.mlp = MLP(spec)


class Eagle3Head(DraftHead):
    """One EAGLE-3 draft layer with its fc, norm and draft-vocabulary head (spec/hidden.py's DraftHead)."""

    name = "eagle3"

    def __init__(self, config, backend, max_positions: int, target_layers: int):
        super().__init__()
        if int(getattr(config, "num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"an EAGLE-3 head has one decoder layer; this one has {config.num_hidden_layers}"
            )
        self.config = config
        spec = self.spec = DecoderSwitches(config, family_qkv_bias=False, qk_norm=False)
        self.hidden_size = spec.hidden
        self.target_hidden_size = int(getattr(config, "target_hidden_size", None) or spec.hidden)
        self.vocab_size = spec.vocab_size  # the target's vocabulary
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or spec.vocab_size)
        self.tap_layers = aux_layer_ids(config, target_layers)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.fc = Linear(3 * self.target_hidden_size, spec.hidden, bias=False)
        self.layers = nn.ModuleList([_Layer(spec, backend)])
        self.norm = RMSNorm(spec.hidden, spec.eps)
        self.lm_head = Linear(spec.hidden, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        self.rotary = RotaryEmbedding(config, spec.head_dim, max_positions)
        self.embed_tokens: nn.Embedding | None = (
            None  # its own when the checkpoint has one, else the target's
        )

    # -- the target side: what the runner keeps of each target token ------------------------------
    def fuse(self, aux: list[torch.Tensor], final: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat(aux, dim=-1))

    # -- the draft side ---------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the LM head, the hidden state the next position reads)."""
        layer = self.layers[0]
        embed = self.embed_tokens if self.embed_tokens is not None else self._target[0].embed_input_ids
        e = layer.input_layernorm(embed(input_ids))
        if self.norm_before_residual:
            h = residual = layer.hidden_norm(hidden)
        else:
            residual, h = hidden, layer.hidden_norm(hidden)
        cos, sin = self.rotary.cos_sin(ctx.positions, e.dtype)
        a = layer.self_attn(torch.cat([e, h], dim=-1), cos, sin, ctx.kv_caches[0], ctx.attn)
        y, residual = layer.post_attention_layernorm.forward_residual(a, residual)
        return self.norm.forward_residual(layer.mlp(y), residual)

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        """Greedy draft ids in the target's vocabulary."""
        ids = self.lm_head(normed).argmax(dim=-1)
        return ids + self.d2t[ids]

    # -- weights ----------------------------------------------------------------------------------
    def load_weights(self, weights, target_model) -> None:
        """The checkpoint's tensors; without its own embedding the target's serves (a VLM's too)."""
        filler = ParamFiller(self)
        has_d2t = False
        for name, tensor in weights:
            name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name == "t2d":
                continue
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise ValueError(
                        f"d2t has shape {tuple(tensor.shape)}; the draft vocabulary is "
                        f"{self.draft_vocab_size}"
                    )
                self.d2t.copy_(tensor.to(torch.long))
                has_d2t = True
                continue
            if name == "embed_tokens.weight":
                if tensor.shape != (self.vocab_size, self.hidden_size):
                    raise ValueError(f"embed_tokens has shape {tuple(tensor.shape)}")
                self.embed_tokens = nn.Embedding.from_pretrained(tensor, freeze=True)
                continue
            target, offset, rows = decoder_param(name, self.spec, tied=False)
            filler.put(target, tensor, name, offset, rows)
        filler.check_complete()
        if not has_d2t and self.draft_vocab_size != self.vocab_size:
            raise ValueError("the EAGLE-3 checkpoint has a smaller draft vocabulary but no d2t map")
        self._target = (target_model,)  # not a submodule: no copy of its weights
        if (
            int((self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)).max())
            >= self.vocab_size
        ):
            raise ValueError("the EAGLE-3 d2t map points past the target's vocabulary")


def build_eagle3_head(spec, target, target_source, backend, max_model_len: int, device, dtype) -> Eagle3Head:
    """The EAGLE-3 head at spec.model, refused when its vocabulary or hidden size does not fit."""
    from foveal.speculative.hidden import check_fits, open_head_checkpoint

    folder = open_head_checkpoint(spec.model)
    with torch.device("meta"):
        head = Eagle3Head(
            folder.hf_config, backend, max_model_len + spec.num_speculative_tokens, target.spec.num_layers
        )
    check_fits(spec, head.vocab_size, target.spec.vocab_size, head.target_hidden_size, target.spec.hidden)
    head = head.to_empty(device=device).to(dtype)
    head.reset_buffers(device)
    head.load_weights(folder.weights(dtype, device), target)
    return head
