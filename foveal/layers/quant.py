"""Linear layers on block-quantized weights, computed by a native AVX2 kernel (cpu_quant.c; AVX-512 and
VNNI where the CPU has them) on CPUs.

A GGUF checkpoint's Q4_0 / Q4_1 / Q8_0 weights run as stored (`--quantization gguf`), the way
llama.cpp runs them: the activations are quantized per block of 32 to int8 (llama.cpp's Q8_1) and the
block dot products are exact integer sums, so the result is the dequantized weights times the
int8-rounded activations: ~0.5% relative error per layer on random data, up to ~1.5% on SmolLM2's
activations, and next-token log-probabilities within ~0.35 nats of the dense model's
(tests/test_quant_linear.py). Each row is quantized on its own, so a row's result does not depend on
the batch. Packed Q4 weights take 0.625 byte per weight, as GGUF's Q4_1 (fp32 copies: 4). On the
2-vCPU AVX2 dev host SmolLM2's linears ran 1.3-3.7x the dense CPU path at 1-16 rows and 1.4-1.7x at 128
(benchmarks/cpu_kernels.py, session 7), the int8 Q8_0 path and vectorized activation quantization of
session 8 took another 1.1-1.5x, and `foveal serve` gives 2.25x the dense default's throughput at 16
streams (benchmarks/RESULTS.md). Where the CPU has AVX-512 and VNNI the kernel uses them (16 columns
per zmm from 8 rows on; vpdpbusd for int8 weights): on a Zen 5 EPYC 1.13x a 16-row decode step and
1.36x a 128-token prefill, bit-identical to the AVX2 build (session 21).

Two packed formats, blocks of 32 along K: 4-bit with w = d q + m, q in 0..15 (Q4_1 as stored; Q4_0
has m = -8 d), and int8 with w = d q (Q8_0: the tied LM head of most small GGUFs). llama.cpp's K-quant
files (Q4_K_M, Q5_K_M, Q6_K) and Q5_0 / Q5_1 are repacked into them at load (REPACKED below): Q4_K's
superblocks into 4-bit blocks of 32 with their scales rounded to fp16, the 5- and 6-bit types
requantized to int8 per block of 32 from the values the file stores.

    qw = QuantWeight.from_gguf(raw_rows, "Q4_1", rows=N, cols=K)
    y = qw.linear(x)        # x [M, K] f32/bf16 -> y [M, N] same dtype
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path

import numpy as np
import torch

from foveal import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.c")
QK = 32
PANEL = 8
# GGUF types whose blocks the kernel's two formats hold as stored: bytes per block of 32 weights
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# GGUF types repacked at load: Q4_K into the 4-bit format (each 32-weight sub-block's scale d * sc and
# min dmin * m rounded to float16: 2^-11 of each at most, where the 4 bits' step is 1/15 of the block's
# range), Q5_0 into int8 exactly (q - 16, the same d), the other 5- and 6-bit types requantized to int8
# per block of 32 (scale max|w| / 127 as float16: at most half an int8 step off, an eighth of a 6-bit
# step). Q4_K_M, Q5_K_M and Q6_K files mix these (llama.cpp writes Q5_0 where a row is no whole number
# of Q4_K's 256-weight superblocks).
REPACKED = ("Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
TYPES = (*BLOCK_BYTES, *REPACKED)
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_INPUT = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's is_bf16 flag


def kernel():
    """The built kernel's entry (foveal_qlinear), or None (no AVX2/FMA, no compiler, a failed build:
    logged once). Where the CPU has them it uses AVX-512 and VNNI (`isa`)."""
    return build(wide=True)


@functools.cache
def build(wide: bool = True):
    """foveal_qlinear built for this CPU (wide: AVX-512 and VNNI where it has them) or with AVX2 alone
    (-DFOVEAL_AVX2_ONLY: what a CPU without them runs; the tests compare the two, which must agree bit
    for bit)."""
    lib = _library(wide)
    if lib is None:
        return None
    args = [_P, _I64, _I, _I64, _I64, _P, _P, _P, _P, _I, _I64, _P, _P, _I64, _I]
    return native.Entry(lib.foveal_qlinear, args)


@functools.cache
def _library(wide: bool):
    if not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        log.info("this CPU has no AVX2/FMA/F16C: quantized GGUF weights are dequantized")
        return None
    return native.load(SOURCE, "quantized-linear kernel", () if wide else ("-DFOVEAL_AVX2_ONLY",))


def isa() -> str:
    """The instructions the kernel this CPU runs is built on: AVX2, + AVX-512, + VNNI; "" without one."""
    lib = _library(True)
    if lib is None:
        return ""
    bits = lib.foveal_qlinear_isa()
    return " + ".join(["AVX2"] + ["AVX-512"] * bool(bits & 2) + ["VNNI"] * bool(bits & 1))


def runs_packed(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    """`quantization` auto / gguf / none -> whether a GGUF's blocks run packed on `device` (the native
    AVX2 kernel takes float32 and bfloat16 activations on CPUs); gguf where it cannot: an error off the
    CPU, a warning (dense) without the kernel."""
    if mode == "none" or (mode == "auto" and device.type != "cpu"):
        return False
    if device.type != "cpu":
        raise ValueError(f"quantization gguf runs on CPUs only (the device is {device}); use auto or none")
    if dtype not in (torch.float32, torch.bfloat16):
        if mode == "gguf":
            log.warning(
                "quantization gguf takes float32 or bfloat16 activations, not %s: dense weights", dtype
            )
        return False
    if kernel() is None:
        if mode == "gguf":
            log.warning("quantization gguf needs an AVX2 CPU and a C compiler: weights are dequantized")
        return False
    return True


_scratch = threading.local()


def _scratch_for(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This thread's int8 activations [rows, k] and per-block scales and sums [rows, k / 32], reused
    across calls (grown when a call needs more)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf[0].numel() < rows * k:
        n = max(rows * k, 64 * 1024)
        buf = _scratch.buf = (
            torch.empty(n, dtype=torch.int8),
            torch.empty(n // QK),
            torch.empty(n // QK),
        )
    return buf


def _blocks(raw: torch.Tensor, rows: int, cols: int, kind: str) -> torch.Tensor:
    """[rows, blocks a row, bytes a block] of GGUF type `kind`."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    if cols % size:
        raise ValueError(f"{kind} weight with {cols} columns: not a multiple of {size}")
    raw = raw.reshape(rows, -1)
    if raw.dtype != torch.uint8 or raw.shape[1] != cols // size * nbytes:
        raise ValueError(f"{kind} weight [{rows}, {cols}]: {tuple(raw.shape)} {raw.dtype} raw bytes")
    return raw.reshape(rows, cols // size, nbytes)


def _half(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields [..., 2] (uint8) -> float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 4-bit fields [..., 16] -> q [..., 32]: element j < 16 in byte j's low nibble, j + 16 high."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def planes_from_gguf(raw: torch.Tensor, kind: str, rows: int, cols: int):
    """(q [N, K], d [N, K/32] float32, m [N, K/32] float32 or None): 4-bit q in 0..15 with w = d q + m,
    or (Q8_0 and the requantized REPACKED types, m None) int8 q with w = d q."""
    if kind not in TYPES:
        raise ValueError(f"no quantized kernel for {kind}; supported: {', '.join(TYPES)}")
    if kind == "Q4_K":
        return _q4_k_planes(_blocks(raw, rows, cols, kind), rows, cols)
    if kind == "Q5_0":  # w = d (q - 16), q in 0..31: int8 q - 16 with the same d, exactly
        b = _blocks(raw, rows, cols, kind)
        high = (b[..., 2:6].contiguous().view(torch.int32) >> torch.arange(32, dtype=torch.int32)) & 1
        q = _nibbles(b[..., 6:]).to(torch.int32) | high << 4
        return (q - 16).to(torch.int8).reshape(rows, cols), _half(b[..., 0:2]), None
    if kind in REPACKED:
        return int8_planes(dequantize(raw, kind, cols))
    b = _blocks(raw, rows, cols, kind)
    d = _half(b[..., 0:2])
    if kind == "Q4_1":
        return _nibbles(b[..., 4:]).reshape(rows, cols), d, _half(b[..., 2:4])
    if kind == "Q4_0":
        return _nibbles(b[..., 2:]).reshape(rows, cols), d, -8 * d
    return b[..., 2:].contiguous().view(torch.int8).reshape(rows, cols), d, None


def _q4_k_planes(b: torch.Tensor, rows: int, cols: int):
    """Q4_K superblocks [rows, K / 256, 144] (d, dmin as fp16, twelve bytes of 6-bit scales and mins for
    the eight 32-weight sub-blocks, then 128 bytes of nibbles: 64 weights per 32 bytes, the first 32 in
    the low nibbles) -> 4-bit planes, w = (d sc) q - (dmin m) with both products rounded to fp16."""
    d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])
    sc = b[..., 4:16].long()
    lo, hi = sc[..., 0:4], sc[..., 4:8]  # sub-blocks 0-3: 6 bits of bytes 0-3 (scale) and 4-7 (min)
    scale = torch.cat([lo & 63, (sc[..., 8:12] & 15) | ((lo >> 6) << 4)], -1)
    mins = torch.cat([hi & 63, (sc[..., 8:12] >> 4) | ((hi >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(rows, -1, 4, 32)
    q = torch.stack([qs & 15, qs >> 4], dim=3).reshape(rows, cols)  # chunk, nibble, byte
    ds = (d[..., None] * scale).half().float().reshape(rows, -1)
    ms = (-dmin[..., None] * mins).half().float().reshape(rows, -1)
    return q, ds, ms


def int8_planes(w: torch.Tensor):
    """Float weights [N, K] -> int8 planes per block of 32 (what Q8_0 stores): d = max|w| / 127 rounded
    to fp16, q = w / d rounded to nearest."""
    n, k = w.shape
    wb = w.float().reshape(n, k // QK, QK)
    d = (wb.abs().amax(-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, torch.round(wb / d.clamp_min(1e-30)[..., None]), 0)
    return q.clamp_(-127, 127).to(torch.int8).reshape(n, k), d, None


def _panels(t: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """[N, ...] -> [N rounded up to PANEL, ...], padded with `fill`."""
    pad = -t.shape[0] % PANEL
    return torch.cat([t, t.new_full((pad, *t.shape[1:]), fill)]) if pad else t


def _fp16(t: torch.Tensor, what: str) -> torch.Tensor:
    """Scales as float16: exact for GGUF's (stored as fp16; Q4_0's m = -8 d too, a power of two)."""
    h = t.to(torch.float16)
    if not torch.equal(h.float(), t.float()):
        raise ValueError(f"the {what} scales are not float16 values (GGUF blocks store them as fp16)")
    return h


def pack(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """The kernel's layout (see cpu_quant.c): panels of 8 columns, per block of 32 along K the weights
    (4-bit: 128 bytes of nibbles; int8: 256 bytes) then d[8] (and for 4-bit m[8]) as float16: the
    same bytes per weight as GGUF's blocks, for a single stream reads every weight once a token."""
    k = q.shape[1]
    nb = k // QK
    q, d = _panels(q), _panels(_fp16(d, "d"))
    panels = q.shape[0] // PANEL

    def scales(t):
        return t.reshape(panels, PANEL, nb).transpose(1, 2).contiguous().view(torch.uint8)

    if m is None:  # int8: q[p*8 + c, b*32 + g*4 + j] -> byte (p, b, g, c, j)
        w = q.view(torch.uint8).reshape(panels, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4)
        return torch.cat([w.reshape(panels, nb, 256), scales(d)], dim=2).contiguous()
    # 4-bit: q[p*8 + c, b*32 + h*16 + g*4 + j] -> byte (p, b, g, c, j), nibble h
    q = q.reshape(panels, PANEL, nb, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)
    nib = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(panels, nb, 128)
    return torch.cat([nib, scales(d), scales(_panels(_fp16(m, "m")))], dim=2).contiguous()


class QuantWeight:
    """A block-quantized weight [N, K], packed for the kernel: 4-bit (Q4_0, Q4_1) or int8 (Q8_0)."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, kind: str):
        self.out_features, self.in_features = q.shape
        self.int8, self.kind = m is None, kind
        self.packed = pack(q, d, m)

    @classmethod
    def from_gguf(cls, raw: torch.Tensor | np.ndarray, kind: str, rows: int, cols: int) -> QuantWeight:
        raw = torch.as_tensor(np.ascontiguousarray(raw)) if isinstance(raw, np.ndarray) else raw
        return cls(*planes_from_gguf(raw, kind, rows, cols), kind)

    @property
    def nbytes(self) -> int:
        return self.packed.numel()

    def rows(self, start: int, stop: int) -> QuantWeight:
        """The weight's rows [start, stop) as a QuantWeight sharing this one's memory (an expert's rows
        of a mixture's stacked weight); both ends on a panel boundary (or stop at the last row)."""
        if start % PANEL or (stop % PANEL and stop != self.out_features) or not 0 <= start < stop:
            raise ValueError(f"rows {start}:{stop} do not fall on panels of {PANEL}")
        view = QuantWeight.__new__(QuantWeight)
        view.out_features, view.in_features = stop - start, self.in_features
        view.int8, view.kind = self.int8, self.kind
        view.packed = self.packed[start // PANEL : -(-stop // PANEL)]
        return view

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [N, K] (tests, fallbacks)."""
        p = self.packed
        panels, nb = p.shape[0], p.shape[1]
        wbytes = 256 if self.int8 else 128

        def scales(at):
            s = p[:, :, at : at + 2 * PANEL].contiguous().view(torch.float16).float()
            return s.transpose(1, 2).reshape(-1, nb, 1)

        if self.int8:  # (p, b, g, c, j) -> (p, c, b, g, j)
            q = p[:, :, :256].contiguous().view(torch.int8).reshape(panels, nb, 8, PANEL, 4)
            w = q.permute(0, 3, 1, 2, 4).reshape(-1, nb, QK).float() * scales(256)
        else:
            nib = p[:, :, :128].reshape(panels, nb, 4, PANEL, 4)
            q = torch.stack([nib & 15, nib >> 4], dim=2)  # (p, b, h, g, c, j)
            q = q.permute(0, 4, 1, 2, 3, 5).reshape(-1, nb, QK).float()
            w = q * scales(wbytes) + scales(wbytes + 2 * PANEL)
        return w.reshape(-1, nb * QK)[: self.out_features]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] (float32/bfloat16, CPU) -> [..., N] in x's dtype. Written for per-call cost: a
        decode step makes ~120 of these calls."""
        fn = kernel()
        if fn is None:
            raise RuntimeError("the quantized-linear kernel is not available on this machine")
        if x.dtype not in _INPUT or not x.is_cpu:
            raise ValueError(f"quantized linear takes float32/bfloat16 CPU input, not {x.dtype}/{x.device}")
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        rows, k = x2.shape
        if k != self.in_features:
            raise ValueError(f"input has {k} features, the weight {self.in_features}")
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        a, scale, total = _scratch_for(rows, k)
        native.keep(a, scale, total)  # a later, larger call replaces this thread's scratch
        out = torch.empty((rows, self.out_features), dtype=x.dtype)
        if bias is not None:
            bias = bias.float().contiguous()
        fn(
            x2.data_ptr(), x2.stride(0), _INPUT[x.dtype], rows, k, a.data_ptr(), scale.data_ptr(),
            total.data_ptr(), self.packed.data_ptr(), self.int8, self.out_features,
            None if bias is None else bias.data_ptr(), out.data_ptr(), self.out_features,
            torch.get_num_threads(),
        )  # fmt: skip
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


_MOE_ARGS = [_P, _I, _I64, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P,
             _P, _I]  # fmt: skip


@functools.cache
def moe_kernel():
    """foveal_qmoe (a mixture's experts on their packs in one call), or None where the kernel is not."""
    lib = _library(True)
    return None if lib is None else native.Entry(lib.foveal_qmoe, _MOE_ARGS)


class ExpertPacks:
    """A mixture's experts as foveal_qmoe reads them: each expert's packed gate/up [2I, H] (gate rows, then
    up rows) and down [H, I] (QuantWeight views of its stacks), their data pointers and formats."""

    def __init__(self, gate_up: list[QuantWeight], down: list[QuantWeight]):
        self.gate_up, self.down = gate_up, down  # the views the pointers point into, kept alive
        self.hidden, self.inter = down[0].out_features, down[0].in_features

        def table(ws, f, dtype):
            return torch.tensor([f(w) for w in ws], dtype=dtype)

        both = (gate_up, down)
        self.ptr13, self.ptr2 = (table(ws, lambda w: w.packed.data_ptr(), torch.int64) for ws in both)
        self.int8_13, self.int8_2 = (table(ws, lambda w: int(w.int8), torch.int32) for ws in both)


def moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packs: ExpertPacks) -> torch.Tensor:
    """x [T, H] (float32/bfloat16, CPU) -> [T, H]: each token's sum over its k (weight, expert) pairs of
    weight * down(silu(gate(x)) * up(x)) on the experts' packs, in one native call (foveal_qmoe: each
    expert's pairs in one run of rows, so a token's result is the same bits in any batch)."""
    fn = moe_kernel()
    T, H = x.shape
    k, E, inter = ids.shape[1], len(packs.gate_up), packs.inter
    if fn is None or x.dtype not in _INPUT or H != packs.hidden:
        raise ValueError(f"no native experts for {x.dtype} input of {H} features")
    x = x.contiguous()
    ids, weights = ids.to(torch.int64).contiguous(), weights.float().contiguous()
    pairs, width = T * k, max(H, inter)
    a = torch.empty(pairs * width, dtype=torch.int8)
    scale, total = torch.empty(pairs * width // QK), torch.empty(pairs * width // QK)
    index = torch.empty(2 * pairs + 2 * (E + 1), dtype=torch.int64)  # order, where, start, ustart
    h, d = torch.empty(pairs, 2 * inter), torch.empty(pairs, H)
    out = torch.empty(T, H, dtype=x.dtype)
    i = index.data_ptr()
    fn(
        x.data_ptr(), _INPUT[x.dtype], T, H, inter, k, ids.data_ptr(), weights.data_ptr(), E,
        packs.ptr13.data_ptr(), packs.int8_13.data_ptr(), packs.ptr2.data_ptr(), packs.int8_2.data_ptr(),
        a.data_ptr(), scale.data_ptr(), total.data_ptr(), i, i + 8 * pairs, i + 16 * pairs,
        i + 16 * pairs + 8 * (E + 1), h.data_ptr(), d.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def assemble(pieces: list[tuple[int, str, torch.Tensor]], rows: int, cols: int) -> QuantWeight | None:
    """One QuantWeight [rows, cols] from raw GGUF row ranges (offset, type, uint8 [n, bytes]) that
    together cover every row (the shards of a fused q/k/v or gate/up weight); None where they do not
    cover the rows. Where int8 shards sit beside 4-bit ones (a Q4_K_M file's Q6_K v beside Q4_K q and
    k), the 4-bit shards are requantized to int8 too: one format a weight."""
    pieces = sorted(pieces, key=lambda p: p[0])
    parts, at = [], 0
    for offset, kind, raw in pieces:
        if offset != at:
            return None
        parts.append(planes_from_gguf(raw, kind, raw.shape[0], cols))
        at += raw.shape[0]
    if at != rows:
        return None
    if len({p[2] is None for p in parts}) != 1:  # the 4-bit ones requantized from the file's values
        parts = [
            p if p[2] is None else int8_planes(dequantize(r, k, cols)) for p, (_, k, r) in zip(parts, pieces)
        ]
    q, d = (torch.cat([p[i] for p in parts]) for i in range(2))
    m = None if parts[0][2] is None else torch.cat([p[2] for p in parts])
    return QuantWeight(q, d, m, "+".join(sorted({p[1] for p in pieces})))


def dequantize(raw: torch.Tensor, kind: str, cols: int) -> torch.Tensor:
    """Raw GGUF rows (uint8 [n, bytes]) of a type this module packs -> float32 [n, cols], the values the
    file stores: w = d q (+ m) for BLOCK_BYTES' types, gguf's own dequantize for the REPACKED ones."""
    n = raw.shape[0]
    if kind in REPACKED:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        _blocks(raw, n, cols, kind)  # the shape checked
        arr = gguf_dequantize(np.ascontiguousarray(raw.numpy()), GGMLQuantizationType[kind])
        return torch.from_numpy(arr.reshape(n, cols))
    q, d, m = planes_from_gguf(raw, kind, n, cols)
    w = q.float().reshape(n, cols // QK, QK) * d[..., None]
    if m is not None:
        w += m[..., None]
    return w.reshape(n, cols)


def describe(module: torch.nn.Module) -> str:
    """For the start-up log: which weights run quantized."""
    kinds: dict[str, int] = {}
    nbytes = 0
    for p in module.parameters():
        if (qw := getattr(p, "_foveal_quant", None)) is not None:
            kinds[qw.kind] = kinds.get(qw.kind, 0) + 1
            nbytes += qw.nbytes
    if not kinds:
        return "dense weights"
    types = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    return f"{sum(kinds.values())} quantized weights ({types}; {nbytes / 2**20:.0f} MiB packed; {isa()})"
