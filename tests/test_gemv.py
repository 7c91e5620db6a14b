"""The decode-sized linear kernel (foveal.layers.gemv_triton) against torch's float32 product of the same
16-bit values, on CPU tensors in Triton's interpreter (or on CUDA where there is one)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from foveal.layers.gemv_triton import GemvTiles, gemv, gemv_tiles  # noqa: E402
from tests.interpreter import interpreter_rounds_to_nearest_even  # noqa: E402, F401 (autouse)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tensors need Triton's interpreter"


@pytest.mark.parametrize(
    "M,N,K,tiles",
    [
        (1, 40, 96, None),
        (1, 300, 200, GemvTiles(8, 64)),  # bands and steps past N and K: masked edges
        (2, 64, 128, GemvTiles(4, 32, 2)),
        (3, 33, 70, GemvTiles(16, 32)),  # 3 rows in a tile of 4
        (4, 128, 64, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_the_float32_product(M, N, K, tiles, dtype, bias):
    """Within one rounding of the float32 sum to the output type (bf16: 2^-8 relative, fp16: 2^-11)."""
    g = torch.Generator().manual_seed(M * 100 + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    want = x.float() @ w.float().t() + (b.float() if bias else 0)
    got = gemv(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), tiles)
    assert got.shape == (M, N) and got.dtype == dtype
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert ((got.float().cpu() - want).abs() <= ulp * want.abs() + 1e-3).all()


def test_gemv_keeps_leading_dims_and_reads_strided_rows():
    """x [..., K] -> [..., N]; rows that are a slice of a wider buffer are read at their stride."""
    g = torch.Generator().manual_seed(1)
    buf = torch.randn(2, 1, 80, generator=g).to(torch.bfloat16)
    x = buf[..., :64]
    w = (torch.randn(24, 64, generator=g) / 8).to(torch.bfloat16)
    got = gemv(x.to(DEVICE), w.to(DEVICE))
    want = x.float() @ w.float().t()
    assert got.shape == (2, 1, 24)
    assert ((got.float().cpu() - want).abs() <= 2**-8 * want.abs() + 1e-3).all()


def test_gemv_tiles_keep_many_programs_and_a_bounded_step():
    """~256 programs where N allows, 4 to 64 rows a band, the product tile 8,192 elements at most."""
    for M, N, K in [(1, 5120, 2048), (1, 2048, 4096), (1, 151936, 2048), (4, 128, 2048), (2, 6144, 4096)]:
        t = gemv_tiles(M, N, K)
        assert 4 <= t.block_n <= 64 and t.block_n * t.block_k * (1 << (M - 1).bit_length()) <= 8192
        assert -(-N // t.block_n) >= min(256, N // 4)


@pytest.mark.skipif(DEVICE != "cuda", reason="linear() takes the kernel for CUDA tensors only")
def test_linear_takes_the_kernel_up_to_gemv_rows(monkeypatch):
    from foveal.layers import gemv_triton, linear

    rows = []
    real = gemv_triton.gemv
    monkeypatch.setattr(gemv_triton, "gemv", lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    monkeypatch.setattr(gemv_triton, "GEMV_ROWS", 4)
    w = torch.randn(96, 64, device="cuda", dtype=torch.bfloat16)
    for n in (1, 4, 5):
        x = torch.randn(n, 64, device="cuda", dtype=torch.bfloat16)
        want = torch.nn.functional.linear(x, w)
        got = linear.linear(x, w)
        assert (got.float() - want.float()).abs().max().item() <= 2**-7 * want.float().abs().max().item()
    assert rows == [1, 4]
