"""The fused elementwise kernels (foveal.layers.fused) against the torch code they replace, on CPU
tensors in Triton's interpreter (or on CUDA where there is one), and a tiny Llama's logits with the fused
path on vs off (CUDA only).

Exactness (see fused.py): the residual sum and the rotary are bit-exact everywhere, and so is SiLU-mul
on CUDA. The interpreter computes exp with numpy, which is not torch's CPU exp, so SiLU-mul gets a few
fp32 ulps there. RMSNorm's sum of squares cannot follow torch's reduction order, so its output may
differ by a few fp32 ulps, or rarely 2 ulps of a 16-bit dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foveal.layers import fused
from foveal.layers.norm import RMSNorm
from foveal.layers.rotary import apply_rotary, apply_rotary_qk
from foveal.models.base import StepContext
from tests.interpreter import interpreter_rounds_to_nearest_even  # noqa: F401 (autouse)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors need the interpreter
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# max ulp difference allowed, (rms_norm, silu_and_mul), per dtype. rms_norm: its normalized value may be
# an ulp off (sum-of-squares order), which the weight product can make 2 (measured: <= 2 and <= 4 in fp32)
ULPS = {torch.bfloat16: (2, 0), torch.float16: (2, 0), torch.float32: (8, 0)}
if DEVICE == "cpu":  # the interpreter's exp is numpy's, not torch's (measured: <= 4 fp32 ulps)
    ULPS = {torch.bfloat16: (2, 1), torch.float16: (2, 1), torch.float32: (8, 8)}


def max_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-signed floats (0 when equal)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if torch.equal(a, b):
        return 0
    int_t = torch.int32 if a.element_size() == 4 else torch.int16
    return int((a.view(int_t).long() - b.view(int_t).long()).abs().max())


def rand(*shape, dtype, seed=0, scale=1.0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def norm_layer(n: int, dtype, device=DEVICE) -> RMSNorm:
    norm = RMSNorm(n, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(n, generator=torch.Generator().manual_seed(1)))
    return norm.to(device, dtype)


@pytest.fixture
def torch_path():
    """RMSNorm's own torch code, whatever the device (on CUDA it would otherwise take the fused path)."""
    fused.set_fused_ops(False)
    yield
    fused.set_fused_ops(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (33, 576)])
def test_rms_norm_matches_torch(dtype, shape, torch_path):
    norm = norm_layer(shape[-1], dtype)
    x, r = rand(*shape, dtype=dtype, seed=2), rand(*shape, dtype=dtype, seed=3, scale=4.0)
    with torch.no_grad():
        assert max_ulps(fused.rms_norm(x, norm.weight, norm.eps), norm(x)) <= ULPS[dtype][0]
        out, res = fused.add_rms_norm(x, r, norm.weight, norm.eps)
        ref_out, ref_res = norm.forward_residual(x, r)
    assert torch.equal(res, ref_res)
    assert max_ulps(out, ref_out) <= ULPS[dtype][0]


def test_rms_norm_fp32_weight_on_bf16_input(torch_path):
    """torch promotes weight * normed to the weight's dtype; so does the kernel."""
    norm = norm_layer(96, torch.float32)
    x = rand(5, 96, dtype=torch.bfloat16, seed=4)
    with torch.no_grad():
        ref = norm(x)
    out = fused.rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == ref.dtype == torch.float32 and max_ulps(out, ref) <= ULPS[torch.float32][0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_on_strided_heads(dtype, torch_path):
    """Qwen3's q/k norm: per-head norm of a [T, H, hd] view into the qkv buffer."""
    t, h, hd = 6, 3, 64
    qkv = rand(t, (h + 2) * hd, dtype=dtype, seed=5)
    q = qkv[:, : h * hd].view(t, h, hd)
    norm = norm_layer(hd, dtype)
    with torch.no_grad():
        ref = norm(q)
    assert max_ulps(fused.rms_norm(q, norm.weight, norm.eps), ref) <= ULPS[dtype][0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (7, 96), (33, 576)])
def test_silu_and_mul_matches_torch(dtype, rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=dtype, seed=6, scale=3.0)
    gate, up = gate_up.split(inter, dim=-1)
    assert max_ulps(fused.silu_and_mul(gate_up), F.silu(gate) * up) <= ULPS[dtype][1]


def test_silu_and_mul_on_row_strided_input():
    inter = 96
    wide = rand(5, 2 * inter + 32, dtype=torch.bfloat16, seed=7, scale=3.0)
    gate_up = wide[:, : 2 * inter]
    gate, up = gate_up.split(inter, dim=-1)
    assert max_ulps(fused.silu_and_mul(gate_up), F.silu(gate) * up) <= ULPS[torch.bfloat16][1]


def cos_sin(t: int, hd: int, dtype, seed: int = 8, device=DEVICE):
    """A real rope table's rows (both halves equal) at random positions."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.randint(0, 4096, (t,), generator=g).float(), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device, dtype).unsqueeze(1), emb.sin().to(device, dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,hd", [(1, 4, 2, 64), (9, 6, 2, 32), (33, 9, 3, 64)])
def test_rotary_qk_in_place_on_qkv_views(dtype, t, h, kvh, hd):
    qkv = rand(t, (h + 2 * kvh) * hd, dtype=dtype, seed=9, scale=2.0)
    q, k, v = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
    q, k, v = q.view(t, h, hd), k.view(t, kvh, hd), v.view(t, kvh, hd)
    cos, sin = cos_sin(t, hd, dtype)
    ref_q, ref_k, ref_v = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.clone()
    out_q, out_k = fused.rotary_qk_(q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, ref_v)  # the v part of the buffer is untouched


def test_rotary_qk_contiguous_and_shared_row():
    """Separate q/k tensors (after Qwen3's q/k norm), and one cos/sin row broadcast to every token."""
    t, hd = 4, 64
    q, k = rand(t, 5, hd, dtype=torch.bfloat16, seed=10), rand(t, 1, hd, dtype=torch.bfloat16, seed=11)
    cos, sin = cos_sin(1, hd, torch.bfloat16)
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    fused.rotary_qk_(q, k, cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h,kvh,hd", [(1, 4, 2, 64), (9, 6, 2, 32), (33, 16, 8, 128)])
def test_rotary_qk_with_qk_norm_equals_the_norms_then_the_rotary(dtype, t, h, kvh, hd, torch_path):
    """Qwen3's q/k norm in the rotary's launch: each head of the qkv buffer's q and k views normalized
    with its own weight, then rotated, in place, as RMSNorm's torch code then apply_rotary; v untouched.
    The sum of squares runs in another order (as rms_norm's), so an element may be an ulp or two off."""
    qkv = rand(t, (h + 2 * kvh) * hd, dtype=dtype, seed=12, scale=3.0)
    q, k, v = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
    q, k, v = q.view(t, h, hd), k.view(t, kvh, hd), v.view(t, kvh, hd)
    qn, kn = norm_layer(hd, dtype), norm_layer(hd, dtype)
    with torch.no_grad():
        kn.weight.mul_(-0.5)  # q's and k's weights differ
        ref_q, ref_k = (
            apply_rotary(qn(q), *cos_sin(t, hd, dtype)),
            apply_rotary(kn(k), *cos_sin(t, hd, dtype)),
        )
    ref_v = v.clone()
    out_q, out_k = fused.rotary_qk_(q, k, *cos_sin(t, hd, dtype), (qn.weight, kn.weight, qn.eps))
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    for got, want in ((q, ref_q), (k, ref_k)):
        err = (got.float() - want.float()).abs().max().item()
        assert err <= 4 * torch.finfo(dtype).eps * want.float().abs().max().item(), err
        if dtype != torch.float32:  # 16-bit: the ulp of the sum rarely survives the rounding
            assert (got == want).float().mean().item() > 0.95
    assert torch.equal(v, ref_v)


def test_rotary_qk_refuses_norm_weights_of_another_shape_or_dtype():
    q, k = rand(2, 2, 64, dtype=torch.bfloat16), rand(2, 1, 64, dtype=torch.bfloat16)
    cos, sin = cos_sin(2, 64, torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="norm weights"):
        fused.rotary_qk_(q, k, cos, sin, (w.float(), w, 1e-6))
    with pytest.raises(ValueError, match="norm weights"):
        fused.rotary_qk_(q, k, cos, sin, (w[:32], w, 1e-6))


def test_cpu_layers_never_take_the_fused_path(monkeypatch):
    """The CPU path is the torch code, untouched: no kernel wrapper is called."""

    def boom(*args, **kwargs):
        raise AssertionError("fused op called on CPU")

    for name in ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_qk_"):
        monkeypatch.setattr(fused, name, boom)
    norm = RMSNorm(64)
    x = torch.randn(3, 64)
    norm(x), norm.forward_residual(x, x)
    q, k = torch.randn(3, 2, 64), torch.randn(3, 1, 64)
    cos, sin = torch.ones(3, 1, 64), torch.zeros(3, 1, 64)
    rq, rk = apply_rotary_qk(q, k, cos, sin)
    assert torch.equal(rq, q) and torch.equal(rk, k)


# -- a whole model, fused on vs off (CUDA) -------------------------------------------------------


def _llama_logits(model, backend, steps) -> list[torch.Tensor]:
    """Logits of every token of a prefill step (two sequences), then of one decode step."""
    from foveal.attention.base import AttentionBatch

    bs, dev = 16, torch.device("cuda")
    layers, kvh, hd = model.kv_shape
    caches = [torch.zeros(2, 8 * bs, kvh, hd, dtype=model.embed_tokens.weight.dtype, device=dev)] * layers
    caches = [c.clone() for c in caches]
    tables = [[0, 1], [2, 3]]
    out = []
    for ids, starts in steps:
        pos = [s + i for seq, s in zip(ids, starts) for i in range(len(seq))]
        slots = [
            tables[j][p // bs] * bs + p % bs
            for j, seq in enumerate(ids)
            for p in range(starts[j], starts[j] + len(seq))
        ]
        meta = backend.plan(
            AttentionBatch(
                query_lens=[len(s) for s in ids],
                context_lens=list(starts),
                block_tables=tables,
                num_decodes=sum(len(s) == 1 for s in ids),
                slot_mapping=torch.tensor(slots, device=dev),
                block_size=bs,
            ),
            dev,
        )
        flat = torch.tensor([i for s in ids for i in s], device=dev)
        with torch.inference_mode():
            hidden = model(flat, StepContext(torch.tensor(pos, device=dev), caches, meta))
            out.append(model.compute_logits(hidden).float())
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_model_logits_fused_on_vs_off(family, dtype, monkeypatch):
    from foveal.attention import get_backend
    from foveal.models import build_model
    from tests.tiny import tiny_hf_model

    hf = tiny_hf_model(family)
    backend = get_backend("torch", "cuda")
    model = build_model(
        hf.config, backend, max_positions=512, dtype=dtype, device="cuda", weights=hf.state_dict().items()
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13)]
    steps = [(prompts, [0, 0]), ([[7], [9]], [5, 13])]

    calls = []

    def counted(name):
        op = getattr(fused, name)
        return lambda *args: calls.append(name) or op(*args)

    for name in ("add_rms_norm", "silu_and_mul", "rotary_qk_"):
        monkeypatch.setattr(fused, name, counted(name))
    on = _llama_logits(model, backend, steps)
    assert set(calls) == {"add_rms_norm", "silu_and_mul", "rotary_qk_"}  # the model took the fused path
    fused.set_fused_ops(False)
    try:
        off = _llama_logits(model, backend, steps)
    finally:
        fused.set_fused_ops(True)
    # an RMSNorm may round an element differently (its sum of squares runs in another order)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for a, b in zip(on, off):
        assert (a - b).abs().max().item() <= tol
        assert torch.equal(a.argmax(-1), b.argmax(-1))
