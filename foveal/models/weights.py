"""Filling a module's parameters from a stream of HF-named checkpoint tensors, one tensor at a time.

Owns the bookkeeping every model shares: where a tensor goes (a whole parameter, or a row range of a
fused one), shape checks, and the final "every parameter was filled" check. Name mapping is the
model's business. Must never hold more than the tensor being copied.
"""

from __future__ import annotations

import torch
from torch import nn


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
