"""The sampler alone on the CPU (the torch path): milliseconds a step for `--rows` rows of random
logits over a `--vocab` vocabulary (SmolLM2's 49,152 by default) with each parameter set below, every
row the same, then the mixed rows of benchmarks/sampling.py (no penalties history: lists). Median of
`--reps` calls after a warm-up.

    python benchmarks/cpu_sampling.py [--rows 32] [--vocab 49152] [--reps 20]

Run it from another checkout's root (it imports `foveal` from the working directory) for a
before/after; alternate the runs. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.getcwd())

from foveal.request import SamplingParams  # noqa: E402
from foveal.sample.sampler import Sampler, SamplingRow  # noqa: E402

SETS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "top_p 0.95 flat": dict(temperature=1.5, top_p=0.95),  # a flat distribution: a wide kept set
    "top_k 40": dict(temperature=0.7, top_k=40),
    "top_k 40 + top_p 0.9": dict(temperature=0.7, top_k=40, top_p=0.9),
    "min_p 0.05": dict(temperature=0.7, min_p=0.05),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sampling import mixed_params

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(a.rows, a.vocab, generator=g) * 3  # peaked enough that top_p keeps a few hundred
    sampler = Sampler(a.vocab)
    sets = {name: [SamplingParams(**kw)] * a.rows for name, kw in SETS.items()}
    sets["mixed rows"] = mixed_params(a.rows, 16)
    res = {}
    for name, params in sets.items():
        rows = [SamplingRow(p, [1, 2, 3], [4, 5], frozenset([0])) for p in params]
        sampler.sample(logits, rows)
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            sampler.sample(logits, rows)
            times.append(time.perf_counter() - t)
        res[name] = round(statistics.median(times) * 1e3, 2)
        print(f"{name}: {res[name]} ms")
    print(json.dumps({"benchmark": "cpu_sampling", "rows": a.rows, "vocab": a.vocab, "ms": res}))


if __name__ == "__main__":
    main()
