"""Fused elementwise ops of a decoder layer, for CUDA: residual add + RMSNorm, SiLU-and-mul, and RoPE of
q and k in one launch. At batch-1 decode each small torch op is a kernel launch and a memory pass; in
bf16 a Llama layer's elementwise work is about 30 of them (a residual add + RMSNorm is 9, each rotary 5,
SiLU-mul 2), which these kernels make 4.

Each kernel reproduces the torch code it replaces step by step, rounding where torch rounds:

    add_rms_norm  h = x + r (rounded to x's dtype) -> n = fp32(h) * rsqrt(mean(fp32(h)^2) + eps),
                  rounded to x's dtype -> weight * n in the weight's promoted dtype
    silu_and_mul  s = g / (1 + exp(-g)) in fp32, rounded to the dtype -> s * up, rounded
    rotary_qk_    x * cos and rotate_half(x) * sin each rounded to the dtype, then their sum (with
                  Qwen3's q/k norm: each head rms_norm'ed first, in the same launch)

The one step that cannot follow torch exactly is the order of the sum of squares (torch's CUDA reduction
order depends on the shape), so the normalized value can differ by an ulp, and rms_norm's output by up to
2 ulps in bf16/fp16 (about 1 element in 10^5 at 2048 x 8192; none at the decode shapes measured) and 4
in fp32. The other ops match torch on CUDA bit for bit (measured on an H200, triton 3.6, torch 2.11).
The callers (RMSNorm, llama.py) use these only for CUDA tensors while `fused_ops_enabled()`;
the wrappers also take CPU tensors, which Triton's interpreter runs (tests). Triton is imported on the
first call, so CPU users never need it.
"""

from __future__ import annotations

import numpy as np
import torch

_enabled = True
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def set_fused_ops(enabled: bool) -> None:
    """Turn the fused CUDA path on or off (on by default); off, CUDA runs the plain torch code."""
    global _enabled
    _enabled = bool(enabled)


def fused_ops_enabled() -> bool:
    return _enabled


def use_fused(x: torch.Tensor) -> bool:
    """Whether a layer should run its fused op on x: CUDA, enabled, and a dtype the kernels support.
    Callers test `x.is_cuda and use_fused(x)`, so the CPU path pays one attribute read."""
    return x.is_cuda and _enabled and x.dtype in _DTYPES


_kernel_module = None


def _kernels():
    global _kernel_module
    if _kernel_module is None:
        from foveal.layers import fused_kernels  # imports triton

        _kernel_module = fused_kernels
    return _kernel_module


def _check(x: torch.Tensor) -> None:
    if x.dtype not in _DTYPES:
        raise ValueError(f"fused ops support {_DTYPES}, got {x.dtype}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [A, B, n] with unit stride on n (a strided [T, heads, head_dim] view stays a view)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    if x.dim() > 3:
        return x.reshape(-1, *x.shape[-2:])
    return x


def _norm(x, residual, weight, eps):
    _check(x)
    k = _kernels()
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {n}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    xr = _rows(x)
    num_rows = xr.shape[0] * xr.shape[1]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must have x's shape and dtype")
        rr = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        rr, res_out = xr, out
    mean_arg = _mean_arg(x, num_rows, n)
    block = triton_next_pow2(n)
    if num_rows:
        k._rms_norm_kernel[(num_rows,)](
            xr,
            rr,
            weight.contiguous(),
            out,
            res_out,
            xr.shape[1],
            xr.stride(0),
            xr.stride(1),
            rr.stride(0),
            rr.stride(1),
            n,
            float(eps),
            mean_arg,
            HAS_RESIDUAL=residual is not None,
            MEAN_BY_DIV=not x.is_cuda,
            PRECISE=k.PRECISE,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
            enable_fp_fusion=False,
            **k.pdl.launch_args(x),
        )
    return out, res_out


def _mean_arg(x: torch.Tensor, num_rows: int, n: int) -> float:
    """What the kernels' mean of n squares takes: torch's CUDA mean multiplies by float(rows) /
    float(rows * n), i.e. float(1 / n); its CPU mean divides by n."""
    return float(np.float32(num_rows) / np.float32(num_rows * n)) if x.is_cuda else float(n)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward: weight * (fp32(x) * rsqrt(mean(fp32(x)^2) + eps)).to(x.dtype), over the last dim."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward_residual: (rms_norm(x + residual), x + residual) in one pass."""
    return _norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, where gate, up = gate_up.split(inter, dim=-1)."""
    _check(gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim {gate_up.shape[-1]} is not even")
    k = _kernels()
    inter = gate_up.shape[-1] // 2
    x = gate_up
    if x.dim() != 2 or x.stride(-1) != 1:  # rows may be strided, columns not
        x = x.contiguous().view(-1, 2 * inter)
    out = torch.empty(x.shape[0], inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton_next_pow2(inter))
    if x.shape[0] and inter:
        grid = (x.shape[0], (inter + block - 1) // block)
        k._silu_and_mul_kernel[grid](
            x,
            out,
            inter,
            x.stride(0),
            PRECISE=k.PRECISE,
            BLOCK=block,
            num_warps=4,
            enable_fp_fusion=False,
            **k.pdl.launch_args(x),
        )
    return out if gate_up.dim() == 2 else out.view(*gate_up.shape[:-1], inter)


def rotary_qk_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q [T, H, hd] and k [T, KVH, hd] in one launch, IN PLACE; returns (q, k).

    q and k may be strided views (of one qkv buffer); only their last dim must be contiguous.
    cos/sin: [T, 1, hd] (or [T, hd], or one row for all tokens) in q's dtype.
    norms: (q weight [hd], k weight [hd], eps): each head RMS-normalized first, as rms_norm (Qwen3's q/k
    norm), in the same launch; the weights in q's dtype.
    """
    _check(q)
    t, hd = q.shape[0], q.shape[-1]
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != t or k.shape[-1] != hd or hd % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, heads, even head_dim]")
    if not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        raise ValueError("q, k, cos and sin must share one dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim to be rotated in place")
    qw, kw, eps = norms if norms is not None else (q, k, 0.0)
    if norms is not None and (qw.shape != (hd,) or kw.shape != (hd,) or not qw.dtype == kw.dtype == q.dtype):
        raise ValueError(f"q/k norm weights must be [{hd}] in {q.dtype}")
    cos = _table(cos, t, hd)
    sin = _table(sin, t, hd)
    kern = _kernels()
    if t:
        kern._rotary_qk_kernel[(t,)](
            q,
            k,
            cos,
            sin,
            qw.contiguous(),
            kw.contiguous(),
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            q.shape[1],
            k.shape[1],
            hd // 2,
            float(eps),
            _mean_arg(q, t * q.shape[1], hd),
            _mean_arg(k, t * k.shape[1], hd),
            Q_HEADS=triton_next_pow2(q.shape[1]),
            K_HEADS=triton_next_pow2(k.shape[1]),
            HALF=triton_next_pow2(hd // 2),
            NORM=norms is not None,
            MEAN_BY_DIV=not q.is_cuda,
            PRECISE=kern.PRECISE,
            num_warps=4,
            enable_fp_fusion=False,
            **kern.pdl.launch_args(q),
        )
    return q, k


def _table(c: torch.Tensor, t: int, hd: int) -> torch.Tensor:
    """cos or sin as [T, hd] with unit stride on hd (stride 0 on T when one row serves every token)."""
    c = c.reshape(-1, hd)
    if c.shape[0] not in (1, t):
        raise ValueError(f"cos/sin have {c.shape[0]} rows for {t} tokens")
    if c.stride(-1) != 1:
        c = c.contiguous()
    return c.expand(t, hd) if c.shape[0] == 1 else c


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
