"""MTP: a model's own next-token-prediction layers as the drafter (Xiaomi MiMo-7B: a Qwen2 decoder plus
`num_nextn_predict_layers` MTP layers, stored beside the decoder's weights as model.mtp_layers.{i}.*):

    token_layernorm, hidden_layernorm   RMSNorms of the token's embedding and the target's hidden state
    input_proj [H, 2H]                  fuses [hidden_layernorm(h), token_layernorm(embed(x))]
    (a decoder layer)                   input_layernorm, self_attn (q/k/v bias), post_attention_layernorm,
                                        mlp, named as a decoder layer's are, directly under the MTP layer
    final_layernorm                     its output: the target's LM head gives the logits

At position i the layer reads h_i, the target's last (normed) hidden state, and x_{i+1} (its embedding
zeroed at position 0, as MiMo's serving code does) and predicts x_{i+2}; its output is the h the next
chain step reads (spec/hidden.py's ChainProposer drives it). The first MTP layer drafts every step of
the chain (MiMo ships one).
"""

from __future__ import annotations

import logging
import re

import torch

from foveal.layers.linear import Linear
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import RotaryEmbedding
from foveal.models.base import StepContext
from foveal.models.llama import DecoderLayer
from foveal.models.weights import ParamFiller, decoder_param
from foveal.speculative.hidden import DraftHead

log = logging.getLogger(__name__)

_NAME = re.compile(r"^model\.mtp_layers\.(\d+)\.(.*)$")


class MTPHead(DraftHead):
    name = "mtp"
    tap_layers: tuple[int, ...] = ()  # the target's last hidden state only

    def __init__(self, config, target, backend, max_positions: int):
        super().__init__()
        self.config = config
        spec = self.spec = target.spec  # the MTP layer is a decoder layer of the target's family
        self.hidden_size = spec.hidden
        self.token_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.hidden_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.input_proj = Linear(2 * spec.hidden, spec.hidden, bias=False)
        self.layer = DecoderLayer(spec, backend)
        self.final_layernorm = RMSNorm(spec.hidden, spec.eps)
        self.rotary = RotaryEmbedding(config, spec.head_dim, max_positions)
        self._target = (target,)  # embedding and LM head are the target's (not a submodule: no copy)

    def fuse(self, aux: list[torch.Tensor], final: torch.Tensor) -> torch.Tensor:
        return final

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: StepContext):
        target = self._target[0]
        e = target.embed_input_ids(input_ids).masked_fill((ctx.positions == 0)[:, None], 0)
        x = self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(e)], dim=-1))
        cos, sin = self.rotary.cos_sin(ctx.positions, x.dtype)
        out, residual = self.layer(x, None, cos, sin, ctx.kv_caches[0], ctx.attn)
        o = self.final_layernorm(out + residual)
        return o, o

    def draft(self, normed: torch.Tensor) -> torch.Tensor:
        return self._target[0].compute_logits(normed).argmax(dim=-1)

    def load_weights(self, weights) -> None:
        """The first MTP layer's tensors out of the target's checkpoint (everything else is skipped)."""
        filler = ParamFiller(self)
        for name, tensor in weights:
            m = _NAME.match(name)
            if m is None or m.group(1) != "0":
                continue
            rest = m.group(2)
            if rest.split(".")[0] in ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"):
                filler.put(rest, tensor, name)
                continue
            target, offset, rows = decoder_param("layers.0." + rest, self.spec, tied=False)
            filler.put(target.replace("layers.0.", "layer.", 1), tensor, name, offset, rows)
        filler.check_complete()


def build_mtp_head(spec, target, target_source: str | None, backend, max_model_len: int, device, dtype):
    """The MTP head of the checkpoint at spec.model (default: the target's own, `target_source`)."""
    from foveal.speculative.hidden import open_head_checkpoint

    source = spec.model or target_source
    if source is None:
        raise ValueError('speculative method mtp needs the target\'s checkpoint folder (or "model")')
    folder = open_head_checkpoint(source)
    cfg = folder.hf_config
    n = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if n < 1:
        raise ValueError(f"speculative method mtp: {source} has no MTP layers (num_nextn_predict_layers)")
    if cfg.hidden_size != target.spec.hidden or cfg.vocab_size != target.spec.vocab_size:
        raise ValueError(f"speculative method mtp: the MTP layers of {source} do not fit the target")
    if n > 1:
        log.info("%s has %d MTP layers; the first drafts every chain step", source, n)
    with torch.device("meta"):
        head = MTPHead(cfg, target, backend, max_model_len + spec.num_speculative_tokens)
    head = head.to_empty(device=device).to(dtype)
    head.reset_buffers(device)
    head.load_weights(folder.weights(dtype, device))
    return head
