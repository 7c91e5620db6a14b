"""The CPU fused elementwise ops (layers/cpu_fused.c) against the PyTorch code they replace (the same
layers with `fused.set_fused_ops(False)`): residual sums and bf16 rotary bit for bit, RMSNorm within a few
ulps (sum-of-squares order), SiLU-mul within an ulp of bf16 (its own exp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foveal.layers import cpu_fused, fused
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import apply_rotary, apply_rotary_qk
from tests import test_fused_ops as shared
from tests.test_fused_ops import max_ulps

# alone: the kernels' OpenMP paths on torch's threads (`make test` runs the rest on one thread a worker)
pytestmark = [pytest.mark.alone, pytest.mark.skipif(cpu_fused.kernel() is None, reason="no C compiler")]
DTYPES = [torch.bfloat16, torch.float32]


def rand(*shape, dtype, seed=0, scale=1.0):
    return shared.rand(*shape, dtype=dtype, seed=seed, scale=scale, device="cpu")


def norm_layer(n: int, dtype) -> RMSNorm:
    return shared.norm_layer(n, dtype, device="cpu")


def cos_sin(t: int, hd: int, dtype):
    return shared.cos_sin(t, hd, dtype, device="cpu")


NORM_ULPS = {torch.bfloat16: 2, torch.float32: 8}
SILU_ULPS = {torch.bfloat16: 1, torch.float32: 8}
ROTARY_ULPS = {torch.bfloat16: 0, torch.float32: 4}  # fp32: the compiler may fuse a product into an FMA


def reference(fn, *args):
    fused.set_fused_ops(False)
    try:
        with torch.no_grad():
            return fn(*args)
    finally:
        fused.set_fused_ops(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (33, 576)])  # 100: an 8-wide body and a tail
def test_rms_norm(dtype, shape):
    norm = norm_layer(shape[-1], dtype)
    x, r = rand(*shape, dtype=dtype, seed=2), rand(*shape, dtype=dtype, seed=3, scale=4.0)
    with torch.no_grad():
        assert max_ulps(norm(x), reference(norm, x)) <= NORM_ULPS[dtype]
        out, res = norm.forward_residual(x, r)
    ref_out, ref_res = reference(norm.forward_residual, x, r)
    assert torch.equal(res, ref_res)
    assert max_ulps(out, ref_out) <= NORM_ULPS[dtype]
    assert cpu_fused.add_rms_norm(x, r, norm.weight, norm.eps) is not None  # the kernel took it


def test_rms_norm_on_head_views_and_fallbacks():
    """Per-head norms (Qwen3's q/k norm) of contiguous [T, H, hd] run here; a [T, H, hd] view into the
    qkv buffer, an fp32 weight on bf16 input (torch promotes) and a column-strided input are left to the
    PyTorch code, which the layer then runs."""
    norm = norm_layer(64, torch.bfloat16)
    k = rand(6, 3, 64, dtype=torch.bfloat16, seed=4)
    with torch.no_grad():
        assert max_ulps(norm(k), reference(norm, k)) <= NORM_ULPS[torch.bfloat16]
    assert cpu_fused.rms_norm(k, norm.weight, norm.eps) is not None
    qkv = rand(6, 5 * 64, dtype=torch.bfloat16, seed=5)
    q = qkv[:, : 3 * 64].view(6, 3, 64)
    assert cpu_fused.rms_norm(q, norm.weight, norm.eps) is None
    with torch.no_grad():
        assert torch.equal(norm(q), reference(norm, q))
    assert cpu_fused.rms_norm(k, norm.weight.float(), norm.eps) is None
    assert cpu_fused.rms_norm(qkv.t(), torch.ones(6, dtype=torch.bfloat16), 1e-5) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (7, 99), (33, 1536)])
def test_silu_and_mul(dtype, rows, inter):
    wide = rand(rows, 2 * inter + 32, dtype=dtype, seed=6, scale=4.0)
    gate_up = wide[:, : 2 * inter]  # rows strided as in a bigger buffer
    gate_up[0, :3] = torch.tensor([float("nan"), 100.0, -100.0])
    gate, up = gate_up.split(inter, dim=-1)
    got = cpu_fused.silu_and_mul(gate_up)
    want = F.silu(gate) * up
    assert torch.isnan(got[0, 0]) and torch.isnan(want[0, 0])
    got[0, 0] = want[0, 0] = 0
    assert max_ulps(got, want) <= SILU_ULPS[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,hd", [(1, 4, 2, 64), (9, 6, 2, 20), (33, 9, 3, 64)])
def test_rotary_on_qkv_views(dtype, t, h, kvh, hd):
    qkv = rand(t, (h + 2 * kvh) * hd, dtype=dtype, seed=9, scale=2.0)
    q, k, v = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
    q, k, v = q.view(t, h, hd), k.view(t, kvh, hd), v.view(t, kvh, hd)
    before = qkv.clone()
    cos, sin = cos_sin(t, hd, dtype)
    out_q, out_k = apply_rotary_qk(q, k, cos, sin)
    assert cpu_fused.rotary_qk(q, k, cos, sin) is not None
    assert max_ulps(out_q, apply_rotary(q, cos, sin)) <= ROTARY_ULPS[dtype]
    assert max_ulps(out_k, apply_rotary(k, cos, sin)) <= ROTARY_ULPS[dtype]
    assert torch.equal(qkv, before)  # the CPU path returns new tensors


def test_switch_turns_the_cpu_path_off(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("CPU fused op called with fused ops off")

    monkeypatch.setattr(cpu_fused, "kernel", boom)
    norm = RMSNorm(64)
    x = torch.randn(3, 64)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    cos, sin = torch.ones(3, 1, 64), torch.zeros(3, 1, 64)
    reference(lambda: (norm(x), norm.forward_residual(x, x), apply_rotary_qk(q, k, cos, sin)))


def test_rotary_on_separate_q_and_k():
    """q and k not adjacent in one buffer (e.g. after Qwen3's q/k norm): one call each."""
    q, k = rand(5, 4, 64, dtype=torch.bfloat16, seed=10), rand(5, 2, 64, dtype=torch.bfloat16, seed=11)
    cos, sin = cos_sin(5, 64, torch.bfloat16)
    out_q, out_k = cpu_fused.rotary_qk(q, k, cos, sin)
    assert torch.equal(out_q, apply_rotary(q, cos, sin)) and torch.equal(out_k, apply_rotary(k, cos, sin))
