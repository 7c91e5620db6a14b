"""RMSNorm, computed in float32 and cast back, exactly as the reference Llama/Qwen implementations do.
On CUDA (unless turned off in foveal.layers.fused) one fused kernel does the residual add and the norm; on
CPU one native call (layers/cpu_fused.py)."""

from __future__ import annotations

import torch
from torch import nn

from foveal.layers import cpu_fused, fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and fused.use_fused(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if cpu_fused.use(x) and (out := cpu_fused.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(x + residual), also returning the new residual stream (x + residual)."""
        if x.is_cuda and fused.use_fused(x):
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if cpu_fused.use(x) and (out := cpu_fused.add_rms_norm(x, residual, self.weight, self.eps)):
            return out
        residual = x + residual
        return self.forward(residual), residual
