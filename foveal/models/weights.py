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
        with torch.no_grad():
            if rows is None:
                if p.shape != tensor.shape:
                    raise ValueError(f"{source}: shape {tuple(tensor.shape)} != expected {tuple(p.shape)}")
                p.copy_(tensor)
            else:
                p[offset : offset + rows].copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + (p.shape[0] if rows is None else rows)

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}")
