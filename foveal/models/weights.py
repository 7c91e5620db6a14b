"""Filling a module's parameters from a stream of HF-named checkpoint tensors, one tensor at a time.

Owns the bookkeeping every model shares: where a tensor goes (a whole parameter, or a row range of a
fused one), shape checks, and the final "every parameter was filled" check. Name mapping is the
model's business. Must never hold more than the tensor being copied.
"""

from __future__ import annotations

import torch
from torch import nn

from foveal.layers.fp8 import FP8_DTYPES, dequantize_blocks


class ParamFiller:
    def __init__(self, module: nn.Module):
        self.owner = type(module).__name__
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        self.filled: dict[str, int] = {}
        self.quantized: dict[str, list] = {}  # target -> [(row offset, GGUF type, raw rows)]
        self.unfilled: set[str] = set()  # targets that got raw blocks only: no dense values yet

    def put(self, target: str, tensor: torch.Tensor, source: str, offset: int = 0, rows: int | None = None):
        """Copy `tensor` into parameter `target` (rows [offset, offset+rows) of it when rows is given)."""
        p = self.params.get(target)
        if p is None:
            buf = self.buffers.get(target)
            if buf is not None and buf.shape == tensor.shape:  # e.g. a persistent buffer the checkpoint holds
                with torch.no_grad():
                    buf.copy_(tensor)
                return
            raise ValueError(f"checkpoint tensor {source!r} has no place in {self.owner}")
        if rows is None and p.shape != tensor.shape:
            raise ValueError(f"{source}: shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
        if p.dtype == torch.uint8 or tensor.dtype in FP8_DTYPES:
            tensor = self._fp8(target, p, tensor, source, offset, rows)
            if tensor is None:
                return
        if tensor.is_meta:  # raw GGUF blocks only (loader/gguf_loader.py): packed, or dequantized, below
            if getattr(tensor, "gguf_blocks", None) is None:
                raise ValueError(f"{source}: a tensor without values")
            self.unfilled.add(target)
        else:
            with torch.no_grad():
                if rows is None:
                    p.copy_(tensor)
                else:
                    p[offset : offset + rows].copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + (p.shape[0] if rows is None else rows)
        if (blocks := getattr(tensor, "gguf_blocks", None)) is not None:
            self.quantized.setdefault(target, []).append((offset, *blocks))

    def _fp8(self, target: str, p, tensor: torch.Tensor, source: str, offset: int, rows: int | None):
        """A block-quantized FP8 tensor (loader/safetensors_loader.py) into a parameter that keeps FP8
        (uint8 bytes, with an int32 `<target>_scale_inv` holding its float32 scales: FusedMoE's FP8
        experts): its bytes and its scales' rows copied, None returned. Into any other parameter: its
        dequantized values returned, to be copied as any tensor is."""
        scale_inv, block = getattr(tensor, "fp8_scale_inv", None), getattr(tensor, "fp8_block", None)
        if tensor.dtype in FP8_DTYPES and scale_inv is None:
            raise ValueError(f"{source}: an FP8 tensor without its scales")
        scales = self.params.get(target + "_scale_inv")
        if p.dtype != torch.uint8 or scales is None:
            return tensor if scale_inv is None else dequantize_blocks(tensor, scale_inv, block)
        b = p.shape[0] // scales.shape[0]
        n = p.shape[0] if rows is None else rows
        if tensor.dtype != torch.float8_e4m3fn or block != (b, b) or offset % b or n % b:
            raise ValueError(
                f"{source}: {tensor.dtype} in blocks {block} for {target}, which keeps float8_e4m3fn in "
                f"{b} x {b} blocks (rows {offset}-{offset + n})"
            )
        if tuple(scale_inv.shape) != (n // b, scales.shape[1]):
            raise ValueError(
                f"{source}: scales {tuple(scale_inv.shape)} for {tuple(tensor.shape)} in {block}"
            )
        with torch.no_grad():
            p[offset : offset + n].copy_(tensor.view(torch.uint8))
            scales[offset // b : (offset + n) // b].copy_(scale_inv.float().view(torch.int32))
        self.filled[target] = self.filled.get(target, 0) + n
        self.filled[target + "_scale_inv"] = self.filled.get(target + "_scale_inv", 0) + n // b
        return None

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
        self._attach_quantized()

    def _attach_quantized(self) -> None:
        """Parameters whose every row came with raw GGUF blocks get the packed quantized weight that
        `layers.linear.linear` runs (`param._foveal_quant`). Their dense values are filled only where
        the loader sent them (the embedding, whose rows lookups read) or where the blocks cannot run
        packed (pieces of types one weight cannot mix, a parameter off the CPU): dequantized here."""
        if not self.quantized:
            return
        from foveal.layers.quant import assemble, dequantize

        for target, pieces in self.quantized.items():
            p = self.params[target]
            qw = assemble(pieces, p.shape[0], p.shape[1]) if p.dim() == 2 and p.device.type == "cpu" else None
            if qw is not None:
                p._foveal_quant = qw
            elif target in self.unfilled:
                with torch.no_grad():
                    for offset, kind, raw in pieces:
                        p[offset : offset + raw.shape[0]].copy_(dequantize(raw, kind, p.shape[1]))


# HF checkpoint names that we store fused: (our parameter suffix, shard index within it)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def decoder_param(name: str, spec, tied: bool) -> tuple[str | None, int, int | None]:
    """HF decoder tensor name -> (our parameter, row offset, row count); rows only for fused shards
    (q/k/v into qkv_proj, gate/up into gate_up_proj). None when the tensor has no place (a tied head)."""
    if name.startswith("lm_head.") and tied:
        return None, 0, None  # tied: the embedding serves as the head
    name = name.removeprefix("model.")
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[3] in _FUSED:
        fused, idx = _FUSED[parts[3]]
        if fused == "qkv_proj":
            kv = spec.num_kv_heads * spec.head_dim
            sizes = [spec.num_heads * spec.head_dim, kv, kv]
        else:
            sizes = [spec.intermediate, spec.intermediate]
        return ".".join(parts[:3] + [fused] + parts[4:]), sum(sizes[:idx]), sizes[idx]
    return name, 0, None
