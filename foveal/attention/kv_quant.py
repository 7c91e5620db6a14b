"""KV-cache quantization (`--kv-cache-dtype fp8|int8`): the quantized pool layout, quantize/dequantize,
and the bytes a token costs, so the engine can size the pool from the real layout.

Owns the numbers only. It does not decide where K/V go (the attention backend writes and gathers
slots) and never touches block ids, so prefix caching shares quantized blocks as it shares plain ones.

One layer's pool, next to the plain `[2, slots, kv_heads, head_dim]` tensor in the model dtype:

    data  [2 (K,V), slots, kv_heads, head_dim]     fp8 e4m3 or int8 values
    scale [2 (K,V), slots, kv_heads, groups]       x ~= data * scale (symmetric, per group)

A group is `head_dim // groups` consecutive channels of one token and one KV head; its scale is
amax / qmax (448 for e4m3, 127 for int8), so the group's largest value lands on the largest code.
Scales are per token, never per block, so writing a token never rescales its neighbours.

    fp8   one float32 scale per token and head             head_dim 64: 64 + 4 bytes (bf16: 128)
    int8  one bfloat16 scale per 32 channels (2 per head)  head_dim 64: 64 + 4 bytes, rotated basis

Both hold ~1.88x the tokens of a bf16 pool. int8 rounds to a uniform step, so one outlier channel
coarsens its whole group. Its pool therefore holds K and V in a rotated basis, x @ R with R an
orthonormal Hadamard matrix that spreads each outlier over the channels (as QuaRot does); attention
needs no un-rotation of the pool, since (q R)(k R)^T = q k^T and P (v R) R^T = P v: the backend
rotates the queries in and the output back out, O(tokens) work. On SmolLM2-135M (teacher-forced top-1
agreement with the fp32 cache over the 284 positions of tests/test_kv_quant.py; logit RMS error):

    int8, one scale per head      96.8%   0.129        fp8 (e4m3, per-head scale)   93.7%   0.36
    int8, 32-channel groups       98.9%   0.104        bf16 cache, for scale       100%     0.02
    int8, groups + rotation       99.6%   0.056

e4m3 keeps 3 mantissa bits, ~2% error per element whatever the scale or basis, so fp8 is the coarser
format; every flip sits where the fp32 top two logits are within ~0.5 (tests/test_kv_quant.py).
A bf16 scale costs int8 nothing: the codes are computed from the rounded scale.
"""

from __future__ import annotations

import math

import torch

_QMAX = {"fp8": 448.0, "int8": 127.0}  # largest finite e4m3fn value; symmetric int8 keeps -128 unused
_VALUES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# the CPU kernels of index_copy_ have no float8 version: fp8 codes are moved as their uint8 bit patterns
_MOVED_AS = {"fp8": torch.uint8, "int8": torch.int8}
SCALE_DTYPES = {"fp8": torch.float32, "int8": torch.bfloat16}
INT8_GROUP = 32  # channels per int8 scale


def num_groups(kind: str, head_dim: int) -> int:
    """Scales per token and KV head: fp8 one; int8 one per ~32 channels (a divisor of head_dim)."""
    if kind not in _QMAX:
        raise ValueError(f"unknown quantized KV cache dtype {kind!r}; use fp8 or int8")
    if kind == "fp8":
        return 1
    groups = max(1, head_dim // INT8_GROUP)
    while head_dim % groups:  # e.g. head_dim 80: 2 groups of 40
        groups -= 1
    return groups


def quantize(x: torch.Tensor, kind: str, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (values [..., head_dim], scales [..., groups])."""
    qmax = _QMAX[kind]
    xg = x.float().unflatten(-1, (groups, -1))
    # a group of zeros gets the smallest positive scale: its codes stay 0 instead of 0/0
    scale = (xg.abs().amax(-1) / qmax).clamp_min_(torch.finfo(SCALE_DTYPES[kind]).tiny)
    # the codes are computed from the stored (rounded) scale, so a bf16 scale adds no error: at most
    # it moves the largest code by 0.2%, and int8's 127.25 still rounds to 127
    scale = scale.to(SCALE_DTYPES[kind])
    q = xg / scale.float()[..., None]
    if kind == "int8":
        q = q.round_()
    values = q.clamp_(-qmax, qmax).to(_VALUES[kind]).flatten(-2)
    return values, scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., head_dim], scales [..., groups]) -> [..., head_dim] in `dtype` (math in float32)."""
    x = values.float().unflatten(-1, (scale.shape[-1], -1)) * scale.float()[..., None]
    return x.flatten(-2).to(dtype)


def bytes_per_token(kind: str, model_dtype: torch.dtype, kv_heads: int, head_dim: int) -> int:
    """K and V of one token in one layer, scales included."""
    if kind == "auto":
        return 2 * kv_heads * head_dim * torch.empty((), dtype=model_dtype).element_size()
    scale_bytes = torch.empty((), dtype=SCALE_DTYPES[kind]).element_size()
    return 2 * kv_heads * (head_dim + num_groups(kind, head_dim) * scale_bytes)


def rotation(head_dim: int) -> torch.Tensor | None:
    """The int8 pool's basis: a normalized Sylvester Hadamard matrix (symmetric and its own inverse),
    block-diagonal over the largest power-of-two block that divides head_dim (80 -> 5 blocks of 16)."""
    p = head_dim & -head_dim
    if p == 1:
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < p:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return torch.block_diag(*[h / p**0.5] * (head_dim // p))


class QuantizedKVCache:
    """One layer's quantized pool (see the module docstring). The attention backend recognizes it by
    type; the runner and the models pass it through untouched, as they do the plain tensor.

    What it stores and gathers is in the pool's basis (rotated for int8): a reader rotates its queries
    with `to_pool_basis` and its attention output back with `from_pool_basis`."""

    __slots__ = ("kind", "data", "scale", "rot", "_codes")

    def __init__(self, kind: str, num_slots: int, kv_heads: int, head_dim: int, device=None):
        groups = num_groups(kind, head_dim)
        self.kind = kind
        self.data = pool_zeros((2, num_slots, kv_heads, head_dim), _VALUES[kind], device)
        self.scale = pool_zeros((2, num_slots, kv_heads, groups), SCALE_DTYPES[kind], device)
        self._codes = self.data.view(_MOVED_AS[self.kind])  # same storage, a dtype indexing kernels take
        r = rotation(head_dim) if kind == "int8" else None  # fp8's error is relative: no basis helps it
        self.rot = None if r is None else r.to(device)

    @property
    def num_slots(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def to_pool_basis(self, x: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] -> the same vectors in the pool's basis (math in float32, same dtype out)."""
        return x if self.rot is None else (x.float() @ self.rot).to(x.dtype)

    def from_pool_basis(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_pool_basis(x)  # the Hadamard basis change is its own inverse

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k or v [T, kv_heads, head_dim] -> (values, scales) in the pool's basis, as stored."""
        return quantize(x if self.rot is None else x.float() @ self.rot, self.kind, self.scale.shape[-1])

    @property
    def codes(self) -> torch.Tensor:
        """The values as an integer tensor of the same storage (what indexing and store kernels take)."""
        return self._codes

    def store(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Quantize this step's k/v [T, kv_heads, head_dim] into `slots` [T]; returns what was written,
        ((k values, k scales), (v values, v scales)) in the pool's basis, for a caller that reads it."""
        out = []
        for i, x in enumerate((k, v)):
            values, scale = self.quantize(x)
            self._codes[i].index_copy_(0, slots, values.view(self._codes.dtype))
            self.scale[i].index_copy_(0, slots, scale)
            out.append((values, scale))
        return tuple(out)

    def gather_blocks(self, i: int, blocks: torch.Tensor, block_size: int, dtype: torch.dtype):
        """K (i=0) or V (i=1) of whole blocks [n] -> [n, block_size, kv_heads, head_dim] in `dtype`, in
        the pool's basis."""
        codes = self._codes[i].view(-1, block_size, *self._codes.shape[2:]).index_select(0, blocks)
        scale = self.scale[i].view(-1, block_size, *self.scale.shape[2:]).index_select(0, blocks)
        return dequantize(codes.view(self.data.dtype), scale, dtype)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """What a reader effectively sees for k or v [..., head_dim] after a store (tests, references)."""
        basis = x if self.rot is None else x.float() @ self.rot
        values, scale = quantize(basis, self.kind, self.scale.shape[-1])
        return self.from_pool_basis(dequantize(values, scale, torch.float32)).to(x.dtype)


def pool_zeros(shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """A zeroed pool. On a CPU its memory comes from calloc (numpy's zeros): pages the OS hands out
    already zero and maps at first touch, so a GiB pool costs nothing at start-up (torch.zeros writes
    every page: 2.6 s for the default pool on the 2-vCPU host, the first time) and only the slots a
    request uses are ever faulted in. The first 2 MiB of each K / V half are touched here, though: with
    transparent huge pages a fault zeroes 2 MiB, and the first request paid for them (its TTFT 0.13 s
    against 0.04 s for a later one in benchmarks/startup.py; 0.045 s with this)."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pool = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    for half in pool.view(shape[0], -1):
        half[: (2 << 20) // pool.element_size()].zero_()
    return pool


def allocate_kv_caches(
    kind: str,
    num_layers: int,
    num_slots: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device,
) -> list:
    """One pool per layer: a plain tensor in the model dtype for 'auto', else a QuantizedKVCache."""
    if kind == "auto":
        return [pool_zeros((2, num_slots, kv_heads, head_dim), dtype, device) for _ in range(num_layers)]
    return [QuantizedKVCache(kind, num_slots, kv_heads, head_dim, device) for _ in range(num_layers)]
