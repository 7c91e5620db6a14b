"""Linear layers, with the fastest correct GEMM path for the device.

On CPUs without native bf16/fp16 matrix instructions (no AVX512-BF16, AMX or AVX512-FP16), PyTorch
emulates half-precision GEMMs several times slower than fp32. There we compute half-precision linears
as fp32 GEMMs on fp32 copies of the weights and round the result back: the same arithmetic a bf16 GEMM
does (half-precision inputs, fp32 accumulation, half-precision output), 3-5x faster, and the weights
stay stored in half precision. A single row (batch-1 decode) is cheaper natively, so it stays native.

The fp32 copy of each weight is made once and kept (on the weight, refreshed if the weight is modified
in place) while all kept copies fit `FP32_CACHE_BYTES`. Where PyTorch has oneDNN, the kept copy is
prepacked in oneDNN's blocked layout (MKL's `F.linear` repacks the weight on every call). On the AVX2
dev host (`benchmarks/cpu_gemm.py`, benchmarks/RESULTS.md) the packed fp32 GEMMs ran 0.85-2.8x MKL's at
32 rows (faster on every SmolLM2 shape but the 192-wide one) and 0.95-1.4x at 2,048 rows; the
decode_profile prefill step 17.9 -> 13.7 s. Weights past the budget (big models) are upcast per call into
one reused scratch buffer, in cache-sized row chunks (a fresh 100 MB allocation per call costs more in
page faults than the conversion itself; chunks measured 15-35% faster than one big upcast + GEMM).
Results equal one fp32-accumulated GEMM up to summation order.

fp32 models take the same oneDNN-packed copies (same budget) for 4+ rows: that is the default CPU dtype.

Weights loaded from a GGUF file in Q4_0 / Q4_1 / Q8_0 carry a packed copy of their blocks
(`_foveal_quant`, models/weights.py) and run on the quantized kernel instead (layers/quant.py).
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from foveal import native
from foveal.layers import quant

_QUANT_INPUT = (torch.float32, torch.bfloat16)
_HALF = (torch.bfloat16, torch.float16)
_MIN_UPCAST_ROWS = 4
_CHUNK_BYTES = 1 << 20


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


_scratch = threading.local()
FP32_CACHE_BYTES = 2 << 30  # fp32 weight copies kept for the upcast path, over all models in the process
_cached = {"bytes": 0}
# reentrant: a weight freed by a garbage collection that runs inside the locked region (any allocation
# there can trigger one) calls _release on this thread while it holds the lock
_cache_lock = threading.RLock()


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version counter (and cannot change outside it)
        return -1


@functools.cache
def onednn_packing() -> bool:
    """Whether this PyTorch can prepack fp32 weights for oneDNN (checked once on a tiny GEMM, outside
    any recorded step: under one, its .item() would end the recording and cache False for good)."""
    with native.outside_recording():
        try:
            w, x = torch.randn(8, 16), torch.randn(4, 16)
            got = torch.ops.mkldnn._linear_pointwise(x, _pack(w), None, "none", [], "")
            return bool(torch.allclose(got, F.linear(x, w), atol=1e-5))
        except (AttributeError, RuntimeError):
            return False


def _pack(w32: torch.Tensor) -> torch.Tensor:
    # the hint is the batch oneDNN tunes the blocking for; any row count works (32: decode-sized)
    return torch.ops.mkldnn._reorder_linear_weight(w32, 32)


def _kept_fp32(weight: torch.Tensor) -> torch.Tensor | None:
    """The kept fp32 copy of `weight` (made on first use while the budget allows; oneDNN-packed where
    available), or None. The copy is made outside any recorded step (worker/cpu_graphs.py): it is the
    weight's, not the step's, and a packed copy is an opaque tensor a tape cannot hold."""
    hit = getattr(weight, "_foveal_fp32", None)
    version = _version(weight)
    if hit is not None and hit[0] == version:
        return hit[1]
    with _cache_lock:
        if hit is None:
            need = weight.numel() * 4
            if _cached["bytes"] + need > FP32_CACHE_BYTES:
                return None
            _cached["bytes"] += need
            weakref.finalize(weight, _release, need)  # the budget frees up with the weight
        with native.outside_recording():
            copy = weight.float().contiguous()
            if onednn_packing():
                copy = _pack(copy)
        weight._foveal_fp32 = (version, copy)
    return copy


def _release(nbytes: int) -> None:
    with _cache_lock:
        _cached["bytes"] -= nbytes


def _upcast(weight: torch.Tensor) -> torch.Tensor:
    """weight as fp32, in this thread's scratch buffer (valid until the next call)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < weight.numel():
        buf = _scratch.buf = torch.empty(weight.numel(), dtype=torch.float32)
    return buf[: weight.numel()].view(weight.shape).copy_(weight)


def _kept_linear(x: torch.Tensor, kept: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if kept.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), kept, bias, "none", [], "")
    return F.linear(x, kept, bias)


def _upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    xf = x.float()
    bf = None if bias is None else bias.float()
    kept = _kept_fp32(weight)
    if kept is not None:
        return _kept_linear(xf, kept, bf).to(x.dtype)
    n, k = weight.shape
    rows = max(128, _CHUNK_BYTES // (4 * k))
    if n <= 2 * rows:
        return F.linear(xf, _upcast(weight), bf).to(x.dtype)
    # Large weights (the LM head, fused gate/up) in row chunks, each upcast chunk still in cache for its
    # GEMM. Each chunk computes W_chunk @ x^T into contiguous rows of the transposed output (no strided
    # copy per chunk: LM head at 32 rows 29.5 vs 37.7 ms writing out[:, lo:hi]); one transposing cast.
    x2 = xf.reshape(-1, k)
    out_t = torch.empty(n, x2.shape[0], dtype=torch.float32, device=x.device)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        torch.mm(_upcast(weight[lo:hi]), x2.t(), out=out_t[lo:hi])
    if bf is not None:
        out_t += bf[:, None]
    out = out_t.t().to(x.dtype, memory_format=torch.contiguous_format)
    return out.reshape(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda:  # cuBLAS (a Triton GEMV of one row lost to it in the models: RESULTS.md session 40)
        return F.linear(x, weight, bias)
    qw = getattr(weight, "_foveal_quant", None)
    if qw is not None and x.is_cpu and x.dtype in _QUANT_INPUT and quant.kernel() is not None:
        return qw.linear(x, bias)  # a GGUF block-quantized weight, run as stored (layers/quant.py)
    if weight.device.type == "cpu" and x.shape[0] >= _MIN_UPCAST_ROWS:
        if weight.dtype in _HALF and not cpu_has_native(weight.dtype):
            return _upcast_linear(x, weight, bias)
        if (
            weight.dtype == torch.float32
            and x.dtype == torch.float32
            and onednn_packing()
            and not (weight.requires_grad and torch.is_grad_enabled())  # the packed GEMM has no autograd
        ):
            kept = _kept_fp32(weight)  # fp32 weights: a oneDNN-packed copy, same budget
            if kept is not None:
                return _kept_linear(x, kept, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    lora = None  # foveal.lora.stacks.LoRAStacks when LoRA adapters are enabled for this projection

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """`lora`: the step's LoRABatch (StepContext.lora) when some row runs an adapter, else None."""
        if lora is not None and self.lora is not None:
            return self.lora.forward(x, self.weight, self.bias, lora)
        return linear(x, self.weight, self.bias)
