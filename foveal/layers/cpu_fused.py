"""Fused elementwise ops of a decoder layer for CPUs (cpu_fused.c through foveal.native): residual add +
RMSNorm, rotary of q and k, SiLU-and-mul, each one native call instead of 4-10 PyTorch ops (about 1,000
small ops per decode step of a 30-layer model, each ~10 us of dispatch on the 2-vCPU dev host).

They round where the PyTorch code they replace rounds (see cpu_fused.c), as the CUDA kernels in
fused.py do, and share its switch (`fused.set_fused_ops(False)` runs the plain PyTorch code on both
devices). Float32 and bfloat16 only; other dtypes, and machines where the kernel did not build, take the
PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from foveal import native
from foveal.layers import fused

SOURCE = Path(__file__).with_name("cpu_fused.c")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGS = {
    "rms_norm": [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _F, _I],
    "rotary": [_P, _I64, _P, _P, _P, _I64, _I64, _I64, _I],
    "silu_mul": [_P, _I64, _P, _I64, _I64, _I],
}


@functools.cache
def kernel() -> dict | None:
    # no FMA contraction (x*cos + rot(x)*sin rounds each product, as the PyTorch code does) and no
    # reassociation (it would undo the two-step range reduction of exp)
    flags = ("-ffp-contract=off", "-fno-associative-math")
    lib = native.load(SOURCE, "fused CPU elementwise kernel", flags)
    if lib is None:
        return None
    fns = {}
    for op, sig in _SIGS.items():
        for dtype, suffix in _SUFFIX.items():
            fns[op, dtype] = native.Entry(getattr(lib, f"foveal_{op}_{suffix}"), sig)
    return fns


def use(x: torch.Tensor) -> bool:
    """Whether x's op should run here: a CPU tensor of a supported dtype, fused ops on, kernel built."""
    return (
        x.device.type == "cpu" and x.dtype in _SUFFIX and fused.fused_ops_enabled() and kernel() is not None
    )


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, n] with unit stride along n (a view), or None."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * RMSNorm(x) over the last dim, or None where the kernel cannot take x (caller's path)."""
    return _norm(x, None, weight, eps)


def add_rms_norm(x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight * RMSNorm(x + residual), x + residual), or None."""
    return _norm(x, residual, weight, eps)


def _norm(x, residual, weight, eps):
    x2 = _rows(x)
    r2 = None if residual is None else _rows(residual)
    if (
        x2 is None
        or weight.dtype != x.dtype
        or (residual is not None and (r2 is None or residual.dtype != x.dtype))
    ):
        return None
    rows, n = x2.shape
    out = torch.empty(rows, n, dtype=x.dtype)
    res_out = None if residual is None else torch.empty(rows, n, dtype=x.dtype)
    kernel()["rms_norm", x.dtype](
        x2.data_ptr(), x2.stride(0), None if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
        None if res_out is None else res_out.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
        rows, n, eps, torch.get_num_threads(),
    )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def _rotate(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`heads` heads of D per row from x's first element (rows x.stride(0) apart) -> [T, heads, D]."""
    t, _, d = x.shape
    out = torch.empty((t, heads, d), dtype=x.dtype)
    kernel()["rotary", x.dtype](
        x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), t, heads, d,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_qk(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rotate-half rotary of q [T, H, D] and k [T, KVH, D] (views into a qkv buffer are fine) with
    cos/sin [T, 1, D]; new tensors, or None where the layout does not fit. When k's heads follow q's
    in each row (the fused qkv buffer), one call rotates both."""
    t, h, d = q.shape
    for x in (q, k):
        if x.stride(2) != 1 or x.stride(1) != d or x.dtype != q.dtype:
            return None
    if cos.dtype != q.dtype or sin.dtype != q.dtype or cos.numel() != t * d or sin.numel() != t * d:
        return None
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    if k.stride(0) == q.stride(0) and k.data_ptr() == q.data_ptr() + h * d * q.element_size():
        both = _rotate(q, h + k.shape[1], cos, sin)
        return both[:, :h], both[:, h:]
    return _rotate(q, h, cos, sin), _rotate(k, k.shape[1], cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """silu(x[..., :n]) * x[..., n:] for x [..., 2n], or None."""
    x2 = _rows(x)
    if x2 is None:
        return None
    rows, n2 = x2.shape
    out = torch.empty(rows, n2 // 2, dtype=x.dtype)
    kernel()["silu_mul", x.dtype](
        x2.data_ptr(), x2.stride(0), out.data_ptr(), rows, n2 // 2, torch.get_num_threads()
    )
    return out.view(*x.shape[:-1], n2 // 2)
