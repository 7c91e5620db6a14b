"""GPU micro-benchmark: decode-sized linears (1 and 4 rows) on the projection shapes of Qwen3-30B-A3B,
gpt-oss-20b, Llama-3.1-8B and Qwen2.5-VL-7B's language model, bf16: cuBLAS (F.linear) against the Triton
GEMV (foveal/layers/gemv_triton.py) without and with programmatic dependent launch (layers/pdl.py),
each behind an RMSNorm of the same rows, as a decode step runs it.

    python3 benchmarks/gemv.py [--rows 1,4] [--sweep]    # GPU
    python3 benchmarks/gemv.py --check                    # CPU, TRITON_INTERPRET=1: the kernel only

Each case is RMSNorm then the linear, over enough copies of W (>= 256 MB together) that every call reads
W from HBM, not the L2, all captured in one CUDA graph and replayed: us a (norm, linear) pair and the
GB/s of W over that time. --sweep: at one row also the kernel's tiles with PDL (rows of W a program,
columns a step, warps), the rule's first, the three fastest kept. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

SHAPES = {  # name: (N out, K in)
    "qwen3moe.qkv": (5120, 2048),
    "qwen3moe.o": (2048, 4096),
    "qwen3moe.lm_head": (151936, 2048),
    "gptoss.qkv": (5120, 2880),
    "gptoss.o": (2880, 4096),
    "llama8b.qkv": (6144, 4096),
    "llama8b.o": (4096, 4096),
    "llama8b.gate_up": (28672, 4096),
    "llama8b.down": (4096, 14336),
    "llama8b.lm_head": (128256, 4096),
    "qwen7b.qkv": (4608, 3584),
    "qwen7b.o": (3584, 3584),
}


def check() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from foveal.layers.gemv_triton import GemvTiles, gemv

    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 96, 256), (3, 80, 192), (4, 64, 512)]:
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        ref = F.linear(x.float(), w.float())
        got = gemv(x, w, tiles=GemvTiles(16, 64)).float()
        err = (got - ref).abs().max().item()
        assert err < 0.02 * ref.abs().max().item(), err
        print(f"check m={m} n={n} k={k}: max abs err {err:.3g}")


def _us(fn, reps: int = 20) -> float:
    """us a call of fn: captured in a CUDA graph after a warm-up, the replays timed (their median)."""
    import gpu_workloads as gw

    return gw._time_cuda(gw.captured(fn), reps) * 1e6


def _chain_us(linear, on: bool, x, ws, norm_w) -> float:
    """us of RMSNorm then linear(., w) for each w of ws, in one graph, programmatic dependent launch on
    or off (layers/pdl.py ENABLED while captured)."""
    from foveal.layers import fused, pdl

    def run():
        enabled, pdl.ENABLED = pdl.ENABLED, on
        try:
            for w in ws:
                linear(fused.rms_norm(x, norm_w, 1e-6), w)
        finally:
            pdl.ENABLED = enabled

    return _us(run)


def bench(rows: list[int], sweep: bool) -> dict:
    import triton

    from foveal.layers import fused
    from foveal.layers.gemv_triton import GemvTiles, gemv, gemv_tiles

    out = {}
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(fused.rms_norm(x, norm_w, 1e-6), ws[0])

            def timed(linear, on: bool, x=x, ws=ws, norm_w=norm_w) -> float:
                return round(_chain_us(linear, on, x, ws, norm_w) / len(ws), 2)

            mb = n * k * 2 / 1e6
            row = {"MB": round(mb, 1), "cublas_us": timed(F.linear, True)}
            row["gemv_us"] = timed(gemv, False)
            row["gemv_pdl_us"] = timed(gemv, True)
            got = gemv(fused.rms_norm(x, norm_w, 1e-6), ws[0])
            if (got.float() - ref.float()).abs().max().item() > 0.02 * ref.float().abs().max().item():
                raise AssertionError(f"{name} m={m}: the kernel's result is off")
            if sweep and m == min(rows):
                rule = gemv_tiles(m, n, k)
                grid = itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024, 2048), (4, 8))
                cands = [rule] + [
                    t
                    for t in (GemvTiles(*v) for v in grid)
                    if t != rule and t.block_n * t.block_k <= 16384 and t.block_k <= triton.next_power_of_2(k)
                ]
                times = []
                for t in cands:
                    try:
                        times.append((timed(lambda a, b, t=t: gemv(a, b, tiles=t), True), t))
                    except triton.runtime.errors.OutOfResources:
                        continue
                row["gemv_pdl_best"] = [[us, list(t)] for us, t in sorted(times)[:3]]
            for key in ("cublas_us", "gemv_us", "gemv_pdl_us"):
                row[key.replace("_us", "_GBps")] = round(mb / row[key] * 1e3, 1)
            out[f"{name} m={m}"] = row
            print(f"gemv {name} [{n}, {k}] m={m}: {row}", flush=True)
        del ws
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    if a.check:
        check()
        return
    res = bench([int(r) for r in a.rows.split(",")], a.sweep)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "gemv": res}))


if __name__ == "__main__":
    main()
