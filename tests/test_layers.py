"""Layer-level checks: the CPU linear paths (half precision through fp32 copies, oneDNN-packed fp32) equal
one fp32-accumulated GEMM, up to summation order."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from foveal.layers import linear as lin


def assert_fp32_gemm(got: torch.Tensor, x, w, b=None) -> None:
    """`got` is x @ w^T (+ b) with fp32 accumulation, rounded to x's dtype: within one rounding step of
    that dtype (a different summation order may round the other way) and almost everywhere bit-equal."""
    ref32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == ref32.shape and got.dtype == x.dtype
    step = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[x.dtype]
    torch.testing.assert_close(got.float(), ref32, rtol=step, atol=1e-5)
    if x.dtype != torch.float32:
        assert (got == ref32.to(x.dtype)).float().mean() > 0.98


@pytest.fixture
def no_native_half(monkeypatch):
    monkeypatch.setattr(lin, "cpu_has_native", lambda _dt: False)  # force the fp32-copy path


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_half_linear_matches_fp32_accumulation(monkeypatch, no_native_half, dtype, rows, packed):
    if packed and not lin.onednn_packing():
        pytest.skip("this PyTorch has no oneDNN weight packing")
    monkeypatch.setattr(lin, "onednn_packing", lambda: packed)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    got = lin.linear(x, w, b)
    if rows < lin._MIN_UPCAST_ROWS:  # native half GEMM: its own rounding
        ref = F.linear(x.float(), w.float(), b.float())
        assert got.dtype == dtype and torch.allclose(got.float(), ref, rtol=1e-2, atol=1e-2)
        return
    assert_fp32_gemm(got, x, w, b)
    assert w._foveal_fp32[1].is_mkldnn == packed
    x3 = x.view(rows, 1, 96).expand(rows, 2, 96)  # leading dims and a non-contiguous input
    assert_fp32_gemm(lin.linear(x3, w, b), x3, w, b)


def test_chunked_upcast_past_the_budget_matches_whole(monkeypatch, no_native_half):
    """Past the kept-copy budget a big weight is upcast per call in row chunks into a reused scratch
    buffer: same result as one fp32-accumulated GEMM, and a smaller weight afterwards sees no stale
    values."""
    monkeypatch.setattr(lin, "FP32_CACHE_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(9000, 64, generator=g).to(torch.bfloat16)  # 4096 rows per chunk at k=64: 3 chunks
    b = torch.randn(9000, generator=g).to(torch.bfloat16)
    assert_fp32_gemm(lin.linear(x, w, b), x, w, b)
    assert getattr(w, "_foveal_fp32", None) is None
    w2 = torch.randn(7, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(lin.linear(x, w2), F.linear(x.float(), w2.float()).to(torch.bfloat16))


def test_fp32_linear_uses_the_packed_copy(monkeypatch):
    """fp32 weights with 4+ rows take a oneDNN-packed copy (results as F.linear up to summation order);
    with autograd on a weight that wants gradients, plain F.linear (the packed GEMM has no backward)."""
    if not lin.onednn_packing():
        pytest.skip("this PyTorch has no oneDNN weight packing")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 64, generator=g)
    w = torch.randn(300, 64, generator=g)
    b = torch.randn(300, generator=g)
    assert_fp32_gemm(lin.linear(x, w, b), x, w, b)
    assert w._foveal_fp32[1].is_mkldnn
    assert torch.equal(lin.linear(x[:2], w, b), F.linear(x[:2], w, b))  # 2 rows: plain
    wg = torch.nn.Parameter(w.clone())
    lin.linear(x, wg).sum().backward()
    assert wg.grad is not None and getattr(wg, "_foveal_fp32", None) is None


def test_kept_copy_follows_the_weight_and_the_budget(monkeypatch, no_native_half):
    """The kept copy: an in-place change of the weight refreshes it, past the byte budget weights are
    upcast per call, and the budget frees up with the weight."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    assert_fp32_gemm(lin.linear(x, w), x, w)
    assert getattr(w, "_foveal_fp32", None) is not None
    w.mul_(2)  # in place: the kept copy must not be served stale
    assert_fp32_gemm(lin.linear(x, w), x, w)
    used = lin._cached["bytes"]
    monkeypatch.setattr(lin, "FP32_CACHE_BYTES", used)  # no room for another weight
    w2 = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    assert_fp32_gemm(lin.linear(x, w2), x, w2)
    assert getattr(w2, "_foveal_fp32", None) is None
    gc.collect()
    before = lin._cached["bytes"]
    del w
    gc.collect()
    assert lin._cached["bytes"] == before - 300 * 64 * 4  # freed with the weight
