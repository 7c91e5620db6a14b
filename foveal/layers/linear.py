"""Linear layers, with the fastest correct GEMM path for the device.

On CPUs without native bf16/fp16 matrix instructions (no AVX512-BF16, AMX or AVX512-FP16), PyTorch
emulates half-precision GEMMs several times slower than fp32. There we compute half-precision linears
as fp32 GEMMs on upcast copies and round the result back: the same arithmetic a bf16 GEMM does
(half-precision inputs, fp32 accumulation, half-precision output), 3-5x faster, and the weights stay
stored in half precision. A single row (batch-1 decode) is cheaper natively, so it stays native.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

_HALF = (torch.bfloat16, torch.float16)
_MIN_UPCAST_ROWS = 4


@functools.cache
def cpu_has_native(dtype: torch.dtype) -> bool:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        return True  # unknown platform: trust PyTorch's own kernels
    if dtype == torch.bfloat16:
        return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))
    return any(f in flags.split() for f in ("avx512_fp16", "amx_fp16"))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (
        weight.dtype in _HALF
        and weight.device.type == "cpu"
        and x.shape[0] >= _MIN_UPCAST_ROWS
        and not cpu_has_native(weight.dtype)
    ):
        b = None if bias is None else bias.float()
        return F.linear(x.float(), weight.float(), b).to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
