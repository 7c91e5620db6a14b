"""The CUDA LoRA kernel (foveal.lora.ops_triton.lora_expand_fused) against a plain torch loop over the
groups, on CPU tensors in Triton's interpreter (or on CUDA where there is one).

The base GEMM ran over [W; A_0; ...] (ye holds y and every slot's h, rounded to the dtype); the reference
repeats the kernel's rounding steps: ye[r, :out] + h_s @ B[s]^T in fp32, rounded to the dtype. fp32
agrees to accumulation order; 16-bit dtypes to an ulp of the result.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from foveal.lora.ops_triton import lora_expand_fused  # noqa: E402
from foveal.lora.slots import group_rows  # noqa: E402
from tests.interpreter import interpreter_rounds_to_nearest_even  # noqa: F401 (autouse)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors need the interpreter
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tensors need Triton's interpreter"


def make_case(T, IN, OUT, K, S, empty=(), dtype=torch.float32, seed=0):
    """Rows spread over groups 0..S (S: the base group; none in `empty`), scattered over the batch;
    ye = x @ [W; A_0; ...; A_{S-1}]^T as the base GEMM gives it; B with NaN in its unused base slot."""
    g = torch.Generator().manual_seed(seed)
    groups = [s for s in range(S + 1) if s not in empty]
    slots = torch.tensor(groups)[torch.randint(len(groups), (T,), generator=g)].tolist()
    packed = torch.tensor(group_rows([(s, 1) for s in slots], S + 1))
    perm, offs = packed[:T], packed[T:].to(torch.int32)
    W = torch.randn(OUT, IN, generator=g) * IN**-0.5
    A = torch.randn(S, K, IN, generator=g) * IN**-0.5
    B = torch.randn(S + 1, OUT, K, generator=g) * K**-0.5
    B[S] = float("nan")
    x = torch.randn(T, IN, generator=g)
    ye = (x @ torch.cat([W, A.reshape(S * K, IN)]).T).to(dtype)
    return ye.to(DEVICE), B.to(DEVICE, dtype), perm.to(DEVICE), offs.to(DEVICE), slots


def reference(ye, B, slots, OUT, K):
    out = ye[:, :OUT].float().clone()
    for r, s in enumerate(slots):
        if s < B.shape[0] - 1:
            out[r] += ye[r, OUT + s * K : OUT + (s + 1) * K].float() @ B[s].float().T
    return out.to(ye.dtype)


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two 16-bit float tensors (0 when equal)."""

    def ordered(t):  # sign-magnitude bits -> integers in the floats' order
        i = t.view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((ordered(a) - ordered(b)).abs().max())


def check(T, IN, OUT, K, S, empty=(), dtype=torch.float32, seed=0):
    ye, B, perm, offs, slots = make_case(T, IN, OUT, K, S, empty, dtype, seed)
    got = lora_expand_fused(ye, B, perm, offs, S, OUT)
    want = reference(ye, B, slots, OUT, K)
    base = [r for r, s in enumerate(slots) if s == S]
    assert torch.equal(got[base], ye[base, :OUT]), "base rows must be copied exactly"
    assert not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    if DEVICE == "cpu" and dtype != torch.float32:
        assert max_ulps(got, want) <= 1  # the interpreter's dots are numpy's: only sum order differs


@pytest.mark.parametrize(
    "T, OUT, K, S, empty",
    [
        (1, 256, 8, 3, ()),  # decode, one row
        (5, 96, 24, 4, (1,)),
        (37, 256, 48, 3, (0,)),  # first group empty
        (37, 96, 8, 4, (2, 3)),  # adapter groups empty
        (37, 300, 24, 4, (4,)),  # no base row; OUT not a multiple of the tile
        (70, 96, 16, 2, ()),  # more than one row tile per group
    ],
)
def test_fp32(T, OUT, K, S, empty):
    check(T, 64, OUT, K, S, empty, seed=T + K)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half(dtype):
    check(37, 64, 200, 24, 3, dtype=dtype, seed=3)


def test_only_base_rows():
    """No adapter row at all: every row a copy of the GEMM's output."""
    check(9, 32, 64, 16, 3, empty=(0, 1, 2))


def test_tile_rules():
    from foveal.lora.ops_triton import _block_m, _expand_bn

    assert _block_m(1) == 16 and _block_m(4096) == 64
    assert _expand_bn(64, 6144) == 256 and _expand_bn(64, 96) == 128
