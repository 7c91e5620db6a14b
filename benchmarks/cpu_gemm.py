"""Times the linear shapes of one SmolLM2 decode step on this CPU: fp32, native bf16, and bf16 through
Foveal's CPU path (foveal/layers/linear.py: kept fp32 copies, oneDNN-packed where available), plus fp32
GEMM efficiency against N at M=32 and at a prefill-sized M=2048, MKL's `F.linear` vs a oneDNN-packed
weight.

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


def _gemm(x: torch.Tensor, w: torch.Tensor, packed: bool):
    """x @ w^T through MKL's F.linear, or through a oneDNN-packed copy of w (Foveal's CPU path)."""
    if not packed:
        return lambda: F.linear(x, w)
    p = lin._pack(w)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")


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
        "bf16_foveal_ms": bench(lambda: lin._upcast_linear(xb, wb, None)),
    }
    res["onednn_packing"] = lin.onednn_packing()
    for rows in (32, 2048):
        xx = torch.randn(rows, k)
        for name, packed in (("mkl", False), ("onednn", True)):
            if packed and not res["onednn_packing"]:
                continue
            gflops = {}
            for nn in (192, 576, 960, 1536, 3072, 49152):
                ww = torch.randn(nn, k)
                gflops[nn] = round(
                    2 * rows * nn * k / bench(_gemm(xx, ww, packed), 10 if rows == 32 else 3) / 1e6, 1
                )
            res[f"fp32_gflops_by_n_m{rows}_{name}"] = gflops
    print(
        f"M={m} K={k} N={n}: fp32 {res['fp32_ms']:.2f} ms, bf16 native {res['bf16_native_ms']:.2f} ms, "
        f"bf16 Foveal path {res['bf16_foveal_ms']:.2f} ms"
    )
    for key, val in res.items():
        if key.startswith("fp32_gflops"):
            print(f"{key} (K={k}):", val)
    print(json.dumps({k_: (round(v, 3) if isinstance(v, float) else v) for k_, v in res.items()}))


if __name__ == "__main__":
    main()
