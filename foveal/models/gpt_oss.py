"""gpt-oss (openai/gpt-oss-20b, -120b) on llama.py's decoder: layers alternate a sliding window (128)
and full attention, q/k/v/o carry biases, every head has an attention sink (one more softmax logit, of
a zero value: the backends take `sinks`), rope is YaRN, and every layer is a mixture of experts: a
router with a bias (the top k of its logits, a softmax over them) and experts with a bias after each
projection and the clamped SwiGLU (foveal/layers/moe.py).

Checkpoint names (both accepted):
    transformers  model.layers.L.mlp.router.{weight, bias}; mlp.experts.gate_up_proj [E, H, 2I] (gate
                  and up columns interleaved), gate_up_proj_bias [E, 2I], down_proj [E, I, H],
                  down_proj_bias [E, H]; self_attn.sinks [heads]
    published     mlp.experts.{gate_up, down}_proj_{blocks, scales}: MXFP4 ([E, rows, cols / 32, 16]
                  bytes of two 4-bit values, [E, rows, cols / 32] power-of-two scales), dequantized at
                  load; the biases as above
Our stacks are FusedMoE's: [E * 2I, H] with each expert's gate rows before its up rows.
"""

from __future__ import annotations

import torch
from torch import nn

from foveal.layers.linear import Linear
from foveal.layers.moe import ClampedSwiGLU, FusedMoE
from foveal.models.llama import Attention, DecoderLayer, DecoderSwitches, LlamaForCausalLM
from foveal.models.weights import ParamFiller

# E2M1 values of the 16 codes (MXFP4)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32: blocks uint8 [..., G, 16] (two codes a byte, low nibble first), scales uint8
    [..., G] (2^(s - 127) for each group of 32 values) -> [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 15], lut[b >> 4]], dim=-1).flatten(-2)  # [..., G, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None])
    return vals.flatten(-2)


def _gate_up_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Interleaved gate/up (gate at even indices along `dim`) -> gate half, then up half."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssMoe(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        hidden, experts = config.hidden_size, config.num_local_experts
        self.router = Linear(hidden, experts, bias=True)
        # transformers before 5.18 keeps these two as constants of its module (1.702, 7.0), not on the config
        glu = ClampedSwiGLU(
            float(getattr(config, "swiglu_alpha", 1.702)), float(getattr(config, "swiglu_limit", 7.0))
        )
        self.experts = FusedMoE(experts, hidden, config.intermediate_size, glu=glu, bias=True)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        return self.experts.routed(x, self.router, self.top_k)  # softmax over the top k logits


class GptOssForCausalLM(LlamaForCausalLM):
    implements_sliding_window = True  # the backends mask the sliding layers' windows

    def __init__(self, config, backend, max_positions: int):
        self._mxfp4: dict[str, torch.Tensor] = {}  # a blocks or scales tensor waiting for its pair
        super().__init__(config, backend, max_positions)

    def _spec(self, config) -> DecoderSwitches:
        return DecoderSwitches(config, family_qkv_bias=False, qk_norm=False)

    def _layer(self, spec: DecoderSwitches, backend, index: int) -> DecoderLayer:
        c = self.config
        attn = Attention(spec, backend)
        if c.layer_types[index] == "sliding_attention":
            attn.window = int(c.sliding_window)
        attn.sinks = nn.Parameter(torch.empty(spec.num_heads))
        return DecoderLayer(spec, backend, GptOssMoe(c), attn)

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, prefix: str = "") -> None:
        parts = name.removeprefix("model.").split(".")
        if len(parts) != 5 or parts[0] != "layers" or parts[2:4] != ["mlp", "experts"]:
            return super().load_weight(filler, name, tensor, prefix)
        base, what = prefix + ".".join(parts[:4]) + ".", parts[4]
        if what.endswith(("_blocks", "_scales")):  # MXFP4: dequantize once both halves arrived
            stack, half = what.rsplit("_", 1)
            other = self._mxfp4.pop(base + stack + ("_scales" if half == "blocks" else "_blocks"), None)
            if other is None:
                self._mxfp4[base + what] = tensor
                return
            blocks, scales = (tensor, other) if half == "blocks" else (other, tensor)
            tensor, what = dequantize_mxfp4(blocks, scales), stack  # [E, rows, cols]: ours, interleaved
        elif what in ("gate_up_proj", "down_proj"):
            tensor = tensor.transpose(1, 2)  # transformers' [E, cols, rows]
        if what in ("gate_up_proj", "gate_up_proj_bias"):
            tensor = _gate_up_first(tensor, 1)
        if what in ("gate_up_proj", "down_proj"):
            tensor = tensor.reshape(-1, tensor.shape[-1])
        filler.put(base + what, tensor, name)

    def load_weights(self, weights) -> None:
        filler = ParamFiller(self)
        for name, tensor in weights:
            self.load_weight(filler, name, tensor)
        if self._mxfp4:
            raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(self._mxfp4))}")
        filler.check_complete()
