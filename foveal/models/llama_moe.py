"""Llama-family decoders whose MLP is a mixture of experts: Qwen3-MoE (Qwen3's attention, softmax
routing renormalized by `norm_topk_prob`, dense MLP layers where `mlp_only_layers` / `decoder_sparse_step`
say) and Mixtral (Mistral's attention, every layer sparse, top-k renormalized). Attention, norms,
rotary and the KV cache are llama.py's; the sparse block is a router (`mlp.gate`) and a FusedMoE
(`mlp.experts`, foveal/layers/moe.py).

Checkpoint names, all accepted:
    published     model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight              (Qwen3-MoE)
                  model.layers.L.block_sparse_moe.experts.E.{w1,w3,w2}.weight, .gate   (Mixtral)
                  ...mlp.experts.{gate_up_proj [E, H, 2I], down_proj [E, I, H]}        (Qwen3-VL-MoE)
    transformers  model.layers.L.mlp.experts.{gate_up_proj [E, 2I, H], down_proj [E, H, I]}
A stacked tensor is transposed when its shape says so; a square one (H == 2I, or H == I) follows the
family's published layout (`stacks_transposed`).
"""

from __future__ import annotations

import torch
from torch import nn

from foveal.layers.fp8 import expert_block
from foveal.layers.linear import Linear
from foveal.layers.moe import FusedMoE
from foveal.models.llama import DecoderLayer, DecoderSwitches, MistralForCausalLM, Qwen3ForCausalLM
from foveal.models.weights import ParamFiller

# a per-expert tensor's projection -> (stack, which part: 0 gate, 1 up, 2 down)
_EXPERT_PROJ = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


class SparseMoeBlock(nn.Module):
    """The router and the experts of one layer."""

    def __init__(
        self, config, hidden: int, num_experts: int, intermediate: int, top_k: int, renormalize: bool
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = Linear(hidden, num_experts, bias=False)
        fp8 = expert_block(config, hidden, intermediate)  # an FP8 checkpoint's experts, run as stored
        self.experts = FusedMoE(num_experts, hidden, intermediate, fp8_block=fp8)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """`lora`: adapters reach the attention projections only (experts and router take none)."""
        return self.experts.routed(x, self.gate, self.top_k, self.renormalize)


class _MoeMixin:
    """What the MoE families share: the sparse layers, and the experts' tensor names."""

    stacks_transposed = False  # the published stacked tensors are [E, cols, rows] (Qwen3-VL-MoE)

    def _sparse(self, index: int) -> bool:
        return True

    def _moe(self, config) -> SparseMoeBlock:
        raise NotImplementedError

    def _layer(self, spec: DecoderSwitches, backend, index: int) -> DecoderLayer:
        mlp = self._moe(self.config) if self._sparse(index) else None
        return DecoderLayer(spec, backend, mlp)

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        parts = name.removeprefix("model.").split(".")
        if len(parts) >= 5 and parts[0] == "layers" and parts[2:4] == ["mlp", "experts"]:
            experts = self.get_submodule(".".join(parts[:4]))
            base = prefix + ".".join(parts[:4]) + "."
            if parts[4] in ("gate_up_proj", "down_proj"):  # stacked: [E, rows, cols] or [E, cols, rows]
                gate_up = parts[4] == "gate_up_proj"
                want = (
                    (2 * experts.intermediate, experts.hidden)
                    if gate_up
                    else (experts.hidden, experts.intermediate)
                )
                if tuple(tensor.shape[1:]) != want or (self.stacks_transposed and want[0] == want[1]):
                    tensor = tensor.transpose(1, 2)
                filler.put(base + parts[4], tensor.reshape(-1, tensor.shape[-1]), name)
                return
            if parts[4].isdigit() and len(parts) >= 6 and parts[5] in _EXPERT_PROJ:
                e, which = int(parts[4]), _EXPERT_PROJ[parts[5]]
                inter, hidden = experts.intermediate, experts.hidden
                if which == 2:
                    filler.put(base + "down_proj", tensor, name, e * hidden, hidden)
                else:
                    filler.put(base + "gate_up_proj", tensor, name, (2 * e + which) * inter, inter)
                return
        super().load_weight(filler, name, tensor, prefix)


class Qwen3Moe(_MoeMixin):
    """Qwen3-MoE's sparse layers and router (also the language model of Qwen3-VL-MoE)."""

    def _sparse(self, index: int) -> bool:
        c = self.config
        step = getattr(c, "decoder_sparse_step", 1) or 1
        only_dense = getattr(c, "mlp_only_layers", None) or ()
        return index not in only_dense and c.num_experts > 0 and (index + 1) % step == 0

    def _moe(self, config) -> SparseMoeBlock:
        return SparseMoeBlock(
            config,
            config.hidden_size,
            config.num_experts,
            config.moe_intermediate_size,
            config.num_experts_per_tok,
            bool(getattr(config, "norm_topk_prob", True)),
        )


class Qwen3MoeForCausalLM(Qwen3Moe, Qwen3ForCausalLM):
    pass


class MixtralForCausalLM(_MoeMixin, MistralForCausalLM):
    def _moe(self, config) -> SparseMoeBlock:
        c = config
        experts = c.num_local_experts
        return SparseMoeBlock(c, c.hidden_size, experts, c.intermediate_size, c.num_experts_per_tok, True)
