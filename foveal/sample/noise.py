"""The randomness of every draw: counter-based noise, a pure function of (row key, vocabulary column).

A row's key is a 64-bit integer: for a seeded request `draw_seed(seed, draw index)` (so its draws
depend on nothing but its own seed and position, whatever batch it shares), for an unseeded one a
number drawn from torch's global CPU generator (so `torch.manual_seed` still fixes a run). The uniform
of column j is a hash of (key, j): two keyed rounds of a 32-bit integer mixer (the "lowbias32"
finalizer, a bijection with low bias), its top 23 bits n as (n + 0.5) / 2^23, a float32 in (0, 1) that
is exact (so -log U is never 0). Every token draw is then
an exponential race, argmax(p / E) with E = -log U (token t wins with probability p_t / sum p).

The same hash runs as torch integer ops (here; any device) and inside the Triton sampling kernel
(sample/triton_sample.py): the two give bit-identical uniforms, so a row draws the same token on the
CPU, on CUDA, alone or in any batch. The plain sampler, speculation's rejection sampler (token draws
and, under a salted key, acceptance uniforms), the diffusion sampler (diffusion/sampling.py: Gumbel
noise from U per canvas row) and their tests share this one contract.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from foveal.device import to_device

_MASK64 = (1 << 64) - 1
M32 = 0xFFFFFFFF
MIX1, MIX2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
INV_2_23 = 1.0 / (1 << 23)


def draw_seed(seed: int, index: int) -> int:
    """A 63-bit key that depends only on (request seed, draw index): splitmix64 of both (row_keys: the
    same on arrays)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


_G1, _G2, _G3, _G4 = (np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03, 0xBF58476D1CE4E5B9,
                                              0x94D049BB133111EB))  # fmt: skip
_U1, _U27, _U30, _U31 = (np.uint64(c) for c in (1, 27, 30, 31))


def row_keys(seeds: list[int | None], indices: list[int], salt: int = 0) -> np.ndarray:
    """One key per row (int64 [n]): seeded rows from (seed ^ salt, index), draw_seed's splitmix64 on
    all of them at once (numpy's uint64 arithmetic wraps as the masks do); unseeded rows from the
    global generator (one call for all of them)."""
    n = len(seeds)
    out = np.empty(n, dtype=np.uint64)
    seeded = [i for i, s in enumerate(seeds) if s is not None]
    if len(seeded) < n:
        free = np.ones(n, dtype=bool)
        free[seeded] = False
        out[free] = torch.randint(0, 1 << 62, (n - len(seeded),)).numpy().astype(np.uint64)
    if seeded:
        s = np.array([(seeds[i] ^ salt) & _MASK64 for i in seeded], dtype=np.uint64)
        at = np.array([indices[i] + 1 for i in seeded], dtype=np.uint64)
        z = s * _G1 + at * _G2
        z = (z ^ (z >> _U30)) * _G3
        z = (z ^ (z >> _U27)) * _G4
        out[seeded] = (z ^ (z >> _U31)) >> _U1
    return out.view(np.int64)


def key_halves(keys, device) -> torch.Tensor:
    """int64 [n, 2]: each key's low and high 32 bits (what the hash takes), for row_keys' array (or a
    list of keys below 2^63)."""
    k = torch.from_numpy(np.asarray(keys, dtype=np.int64).reshape(len(keys)))
    return to_device(torch.stack([k & M32, k >> 32], 1), device)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) in int64 without overflow: c split into 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + ((x * hi) & 0xFFFF) * 65536) & M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def uniforms(halves: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in (0, 1): row r's at columns `cols` ([V] shared by all rows, or [n, K])."""
    k0, k1 = halves[:, 0:1], halves[:, 1:2]
    c = cols.long() if cols.dim() == 2 else cols.long()[None, :]
    h = _mix32(_mix32(c ^ k0) ^ k1)
    return ((h >> 9).to(torch.float32) + 0.5) * INV_2_23


def exponentials(halves: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [n, vocab] Exp(1) draws: E = -log U (on the CPU by cpu_noise.c where it builds: the torch
    ops below take ~5x as long as torch's own exponential_)."""
    return _fill(halves, vocab, uniform=False)


def uniform_matrix(halves: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [n, vocab]: every column's U."""
    return _fill(halves, vocab, uniform=True)


def _fill(halves: torch.Tensor, vocab: int, uniform: bool) -> torch.Tensor:
    if halves.is_cuda:  # one Triton launch (sample/triton_sample.py)
        from foveal.sample.triton_sample import fill_noise

        return fill_noise(halves, vocab, uniform)
    fill = _cpu_kernel() if halves.device.type == "cpu" else None
    if fill is not None:
        halves = halves.contiguous()
        out = torch.empty(halves.shape[0], vocab, dtype=torch.float32)
        fill(halves.data_ptr(), halves.shape[0], vocab, int(uniform), out.data_ptr())
        return out
    u = uniforms(halves, torch.arange(vocab, device=halves.device))
    return u if uniform else -torch.log(u)


@functools.cache
def _cpu_kernel():
    """foveal_noise_fill (cpu_noise.c), or None where no compiler built it."""
    import ctypes
    from pathlib import Path

    from foveal import native

    P, I64 = ctypes.c_void_p, ctypes.c_int64
    source = Path(__file__).with_name("cpu_noise.c")
    return native.entry(
        source, "foveal_noise_fill", "CPU sampling-noise kernel", [P, I64, I64, ctypes.c_int, P]
    )
