"""Times the linear shapes of one SmolLM2 decode step on this CPU: fp32, native bf16, and bf16 through
Foveal's upcast path (foveal/layers/linear.py), plus fp32 GEMM efficiency against N at M=32.

    python benchmarks/cpu_gemm.py

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal.layers import linear as lin  # noqa: E402


def bench(f, n: int = 20) -> float:
    f()
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3


def main() -> None:
    torch.manual_seed(0)
    m, k, n = 32, 576, 1536
    x = torch.randn(m, k)
    w = torch.randn(n, k)
    xb, wb = x.bfloat16(), w.bfloat16()
    res = {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": lin.cpu_has_native(torch.bfloat16),
        "fp32_ms": bench(lambda: F.linear(x, w)),
        "bf16_native_ms": bench(lambda: F.linear(xb, wb)),
        "bf16_upcast_ms": bench(lambda: lin._upcast_linear(xb, wb, None)),
    }
    gflops = {}
    for nn in (192, 576, 960, 1536, 2048, 3072, 4096, 8192, 49152):
        ww = torch.randn(nn, k)
        gflops[nn] = round(2 * m * nn * k / bench(lambda ww=ww: F.linear(x, ww), 10) / 1e6, 1)
    res["fp32_gflops_by_n_at_m32"] = gflops
    print(
        f"M={m} K={k} N={n}: fp32 {res['fp32_ms']:.2f} ms, bf16 native {res['bf16_native_ms']:.2f} ms, "
        f"bf16 upcast {res['bf16_upcast_ms']:.2f} ms"
    )
    print("fp32 GFLOP/s by N (M=32, K=576):", gflops)
    print(json.dumps({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in res.items()}))


if __name__ == "__main__":
    main()
