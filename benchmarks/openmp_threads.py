"""A native kernel's time on a thread that is not the one which opened OpenMP regions first: why
EngineLoop.start calls native.release_openmp_threads(). Each mode runs in a fresh process: 30 random
Q4_1 weights of SmolLM2's gate_up shape (3072 x 576), one row, all 30 called in a loop; the median of
20 loops, per call.

  main          weights built and the kernel timed on the main thread
  thread        built on the main thread (which opens parallel regions), timed on a second thread:
                what `foveal serve` did before (the engine is built on the main thread)
  released      the same, with native.release_openmp_threads() before the second thread starts
  thread-only   built and timed on a second thread; the main thread never opens a region

    python benchmarks/openmp_threads.py [--modes main,thread,released,thread-only] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(mode: str) -> float:
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from foveal import native
    from foveal.layers import quant

    weights, x = [], torch.randn(1, 576)

    def build():
        g = torch.Generator().manual_seed(0)
        for _ in range(30):
            w = torch.randn(3072, 576, generator=g) * 0.05
            raw = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q4_1))
            weights.append(quant.QuantWeight.from_gguf(raw, "Q4_1", 3072, 576))

    out = []

    def bench():
        for _ in range(3):
            for w in weights:
                w.linear(x)
        loops = []
        for _ in range(20):
            t = time.perf_counter()
            for w in weights:
                w.linear(x)
            loops.append(time.perf_counter() - t)
        out.append(statistics.median(loops) / len(weights) * 1e6)

    if mode == "main":
        build()
        bench()
    elif mode == "thread-only":
        th = threading.Thread(target=lambda: (build(), bench()))
        th.start()
        th.join()
    else:
        build()
        bench_main = []  # the main thread opens regions, as building the engine does
        for w in weights[:2]:
            bench_main.append(w.linear(x))
        if mode == "released":
            native.release_openmp_threads()
        th = threading.Thread(target=bench)
        th.start()
        th.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="main,thread,released,thread-only")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps({"us": measure(a.one)}))
        return
    results: dict[str, list[float]] = {}
    for _ in range(a.rounds):  # modes alternate, each in a fresh process
        for mode in a.modes.split(","):
            r = subprocess.run([sys.executable, __file__, "--one", mode], capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(r.stderr)
            results.setdefault(mode, []).append(round(json.loads(r.stdout.splitlines()[-1])["us"], 1))
    for mode, us in results.items():
        print(f"{mode:12s} {' / '.join(f'{u:.1f}' for u in us)} us per call")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
