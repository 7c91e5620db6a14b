"""The batched multi-LoRA Triton kernels (foveal.lora.ops_triton) against a plain torch loop over the
groups, on CPU tensors in Triton's interpreter (or on CUDA where there is one).

The reference repeats the kernels' rounding steps: h = x @ A[s].T in fp32, rounded to the dtype, then
y + h @ B[s].T in fp32, rounded to the dtype. fp32 agrees to accumulation order; 16-bit dtypes to an ulp
of the result, or of h where an fp32 sum lands near a rounding boundary.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from foveal.lora.ops_triton import _lora_add, _split_k, lora_add_triton  # noqa: E402
from tests.interpreter import interpreter_rounds_to_nearest_even  # noqa: F401 (autouse)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors need the interpreter
if DEVICE == "cpu":
    assert os.environ.get("TRITON_INTERPRET") == "1", "CPU tensors need Triton's interpreter"


def make_case(T, IN, OUT, K, num_slots, S1, empty=(), dtype=torch.float32, seed=0, base_rows=True):
    """Random rows over the groups (none in `empty`), perm / offs grouping them, and weights whose
    groups >= num_slots hold NaN."""
    g = torch.Generator().manual_seed(seed)
    groups = [s for s in range(S1) if s not in empty and (base_rows or s < num_slots)]
    slot_of_row = torch.tensor(groups)[torch.randint(len(groups), (T,), generator=g)]
    perm = torch.sort(slot_of_row, stable=True).indices  # rows of a group are scattered over y
    offs = torch.cumsum(torch.bincount(slot_of_row, minlength=S1), 0).to(torch.int32)
    x = torch.randn(T, IN, generator=g)
    y = torch.randn(T, OUT, generator=g)
    A = torch.randn(S1, K, IN, generator=g) * IN**-0.5
    B = torch.randn(S1, OUT, K, generator=g) * K**-0.5
    A[num_slots:] = float("nan")
    B[num_slots:] = float("nan")
    to = dict(device=DEVICE, dtype=dtype)
    return x.to(**to), y.to(**to), A.to(**to), B.to(**to), perm.to(DEVICE), offs.to(DEVICE), slot_of_row


def reference(x, y, A, B, perm, offs, num_slots):
    out = y.clone()
    for s in range(num_slots):
        start = 0 if s == 0 else int(offs[s - 1])
        rows = perm[start : int(offs[s])]
        h = (x[rows].float() @ A[s].float().T).to(x.dtype).float()
        out[rows] = (y[rows].float() + h @ B[s].float().T).to(y.dtype)
    return out


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between two 16-bit float tensors (0 when equal)."""

    def ordered(t):  # sign-magnitude bits -> integers in the floats' order
        i = t.view(torch.int16).int()
        return torch.where(i < 0, -(i & 0x7FFF), i)

    return int((ordered(a) - ordered(b)).abs().max())


def check(x, y, A, B, perm, offs, num_slots, slot_of_row, atol, rtol, split_k=None):
    want = reference(x, y, A, B, perm, offs, num_slots)
    got = y.clone() if y.is_contiguous() else y  # a view is updated where it lies
    if split_k is None:
        lora_add_triton(x, got, A, B, perm, offs, num_slots)
    else:
        _lora_add(x, got, A, B, perm, offs, num_slots, split_k=split_k)
    base = (slot_of_row >= num_slots).to(DEVICE)
    assert torch.equal(got[base], want[base]), "rows of the base group were touched"
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    if DEVICE == "cpu" and x.dtype != torch.float32:
        # the interpreter's dots are numpy's fp32 matmuls, so only the sum order differs from torch's;
        # a GPU's tensor cores round h differently now and then, hence the loose tolerance above
        assert max_ulps(got, want) <= 1
    return got


@pytest.mark.parametrize(
    "T, OUT, K, num_slots, S1, empty",
    [
        (1, 256, 8, 3, 4, ()),  # decode, one row
        (5, 96, 24, 4, 5, (1,)),
        (37, 256, 48, 3, 4, (0,)),  # first group empty
        (37, 96, 8, 4, 5, (2, 3)),  # last adapter group empty
        (37, 96, 24, 4, 4, (1,)),  # no base group: S1 == num_slots
    ],
)
def test_fp32(T, OUT, K, num_slots, S1, empty):
    case = make_case(T, 64, OUT, K, num_slots, S1, empty, seed=T + K)
    check(*case[:6], num_slots, case[6], atol=1e-5, rtol=1e-5)


def test_fp32_strided_views():
    """x with a longer row stride, y a column slice of a wider tensor: the columns around it stay."""
    x, y, A, B, perm, offs, slot_of_row = make_case(37, 64, 256, 48, 4, 5, (2,), seed=7)
    wide_x = torch.randn(37, 80, device=DEVICE)
    wide_x[:, 8:72] = x
    wide_y = torch.randn(37, 300, device=DEVICE)
    wide_y[:, 20:276] = y
    before = wide_y.clone()
    xv, yv = wide_x[:, 8:72], wide_y[:, 20:276]
    assert not xv.is_contiguous() and not yv.is_contiguous()
    check(xv, yv, A, B, perm, offs, 4, slot_of_row, atol=1e-5, rtol=1e-5)
    assert torch.equal(wide_y[:, :20], before[:, :20]) and torch.equal(wide_y[:, 276:], before[:, 276:])
    assert not torch.equal(yv, before[:, 20:276])  # the view itself was written


@pytest.mark.parametrize("split_k", [2, 3])
def test_fp32_split_k(split_k):
    """The split-K shrink (chosen for long IN and few rows on a GPU), forced on a short odd IN;
    with split 3 some programs get no IN step at all."""
    case = make_case(21, 80, 96, 24, 3, 4, (1,), seed=split_k)
    check(*case[:6], 3, case[6], atol=1e-5, rtol=1e-5, split_k=split_k)


def test_split_k_rule():
    assert _split_k(T=1, IN=4096) == 8  # decode, long IN
    assert _split_k(T=1, IN=64) == 1  # short IN
    assert _split_k(T=4096, IN=4096) == 1  # prefill


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half(dtype):
    x, y, A, B, perm, offs, slot_of_row = make_case(37, 64, 96, 24, 4, 5, (1,), dtype=dtype, seed=3)
    check(x, y, A, B, perm, offs, 4, slot_of_row, atol=2e-2, rtol=2e-2)
    # a bf16 decode step with the expand's OUT not a multiple of its tile
    x, y, A, B, perm, offs, slot_of_row = make_case(3, 64, 200, 8, 2, 3, dtype=dtype, seed=4)
    check(x, y, A, B, perm, offs, 2, slot_of_row, atol=2e-2, rtol=2e-2)


def test_all_adapter_groups_empty():
    """Every row in the base group: y is left as it was, though every slot's weights are NaN."""
    x, y, A, B, perm, offs, _ = make_case(9, 64, 96, 16, 3, 4, (0, 1, 2), seed=5)
    A.fill_(float("nan"))
    B.fill_(float("nan"))
    assert offs.tolist() == [0, 0, 0, 9]
    got = y.clone()
    lora_add_triton(x, got, A, B, perm, offs, 3)
    assert torch.equal(got, y)


def test_no_slots_or_rows():
    x, y, A, B, perm, offs, _ = make_case(4, 64, 96, 16, 0, 1, seed=6)
    got = y.clone()
    lora_add_triton(x, got, A, B, perm, offs, 0)
    assert torch.equal(got, y)
    lora_add_triton(x[:0], got[:0], A, B, perm[:0], torch.zeros_like(offs), 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_expand(dtype):
    """The CUDA path's expand: the base GEMM ran over [W; A_0; ...] (ye holds y and every slot's h);
    each adapter row gets y + h_s @ B[s]^T, each base row its y, all into a fresh output."""
    from foveal.lora.ops_triton import lora_expand_fused
    from foveal.lora.slots import group_rows

    T, IN, OUT, K, S = 13, 64, 96, 24, 3
    g = torch.Generator().manual_seed(0)
    W = torch.randn(OUT, IN, generator=g)
    A = torch.randn(S, K, IN, generator=g) * 0.1
    B = (torch.randn(S + 1, OUT, K, generator=g) * 0.1).to(dtype)
    B[S] = float("nan")  # the base slot is never read
    x = torch.randn(T, IN, generator=g)
    slots = torch.randint(0, S + 1, (T,), generator=g).tolist()
    slots[0] = 1  # at least one adapter row and
    slots[1] = S  # one base row
    packed = torch.tensor(group_rows([(s, 1) for s in slots], S + 1))
    perm, offs = packed[:T], packed[T:].to(torch.int32)
    ye = (x @ torch.cat([W, A.reshape(S * K, IN)]).T).to(dtype)
    got = lora_expand_fused(ye, B, perm, offs, S, OUT)
    want = ye[:, :OUT].float().clone()
    for r, s in enumerate(slots):
        if s < S:
            want[r] += ye[r, OUT + s * K : OUT + (s + 1) * K].float() @ B[s].float().T
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=tol, rtol=tol)
    base = [r for r, s in enumerate(slots) if s == S]
    assert torch.equal(got[base], ye[base, :OUT])  # base rows: copied exactly
