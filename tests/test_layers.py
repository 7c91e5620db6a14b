"""Layer-level checks: the CPU half-precision linear path equals a half-precision GEMM's arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foveal.layers import linear as lin


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_half_linear_matches_fp32_accumulation(monkeypatch, dtype, rows):
    monkeypatch.setattr(lin, "cpu_has_native", lambda _dt: False)  # force the upcast path
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float()).to(dtype)  # half inputs, fp32 accumulate, half out
    got = lin.linear(x, w, b)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), ref.float(), rtol=1e-2, atol=1e-2)
    if rows >= lin._MIN_UPCAST_ROWS:
        assert torch.equal(got, ref)
        # the scratch buffer is reused: a smaller weight afterwards must not see stale values
        w2 = torch.randn(7, 96, generator=g).to(dtype)
        assert torch.equal(lin.linear(x, w2), F.linear(x.float(), w2.float()).to(dtype))


def test_chunked_half_linear_matches_whole(monkeypatch):
    """A weight big enough to be processed in row chunks gives the one fp32-accumulated GEMM's result,
    up to summation order: within one half-precision rounding step, and mostly bit-equal."""
    monkeypatch.setattr(lin, "cpu_has_native", lambda _dt: False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(9000, 64, generator=g).to(torch.bfloat16)  # 4096 rows per chunk at k=64: 3 chunks
    b = torch.randn(9000, generator=g).to(torch.bfloat16)
    ref32 = F.linear(x.float(), w.float(), b.float())
    got = lin.linear(x, w, b)
    assert got.shape == ref32.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref32, rtol=2**-7, atol=1e-5)
    assert (got == ref32.to(torch.bfloat16)).float().mean() > 0.99


def test_kept_fp32_copy_follows_the_weight_and_the_budget(monkeypatch):
    """The upcast path keeps each weight's fp32 copy: results equal the per-call upcast, an in-place
    change of the weight refreshes the copy, and past the byte budget weights are upcast per call."""
    monkeypatch.setattr(lin, "cpu_has_native", lambda _dt: False)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    ref = F.linear(x.float(), w.float()).to(torch.bfloat16)
    assert torch.equal(lin.linear(x, w), ref)
    assert getattr(w, "_foveal_fp32", None) is not None
    w.mul_(2)  # in place: the kept copy must not be served stale
    assert torch.equal(lin.linear(x, w), F.linear(x.float(), w.float()).to(torch.bfloat16))
    used = lin._cached["bytes"]
    monkeypatch.setattr(lin, "FP32_CACHE_BYTES", used)  # no room for another weight
    w2 = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(lin.linear(x, w2), F.linear(x.float(), w2.float()).to(torch.bfloat16))
    assert getattr(w2, "_foveal_fp32", None) is None
    import gc

    gc.collect()
    before = lin._cached["bytes"]
    del w
    gc.collect()
    assert lin._cached["bytes"] == before - 300 * 64 * 4  # freed with the weight
