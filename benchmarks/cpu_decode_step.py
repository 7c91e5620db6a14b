"""Recorded decode steps (worker/cpu_graphs.py) against eager ones, in one process: the embedded
SmolLM2 with 16 sequences of 128 random prompt tokens, prefilled, then blocks of `--block` decode steps
alternating between the recorded path and eager (the runner's graphs detached), so this host's drift
hits both alike. Prints the median step time of each; last line JSON.

    python benchmarks/cpu_decode_step.py --quantization gguf
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="gguf", choices=["none", "gguf"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    llm = LLM(dtype=a.dtype, quantization=a.quantization, max_num_seqs=a.seqs)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    steps = 2 * a.block * a.repeats
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True)
    for _ in range(a.seqs):
        eng.add_request(
            llm.processor.request(torch.randint(100, 49000, (128,), generator=g).tolist(), params)
        )
    sched = eng.scheduler
    while sched.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running):
        eng.step()  # prefill every prompt
    for _ in range(4):
        eng.step()  # the recorded path records its bucket
    graphs = eng.runner.graphs
    if graphs is None:
        sys.exit("no recorded steps on this engine (not a CPU, or --enforce-eager)")
    times: dict[str, list[float]] = {"recorded": [], "eager": []}
    for _ in range(a.repeats):
        for mode in times:
            eng.runner.graphs = graphs if mode == "recorded" else None
            for _ in range(a.block):
                t0 = time.perf_counter()
                eng.step()
                times[mode].append((time.perf_counter() - t0) * 1e3)
    eng.runner.graphs = graphs
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"{k:<9} median {v:.1f} ms per {a.seqs}-row decode step ({len(times[k])} steps)")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    print(json.dumps({
        "benchmark": "cpu_decode_step", "commit": commit.strip(), "quantization": a.quantization,
        "dtype": a.dtype, "seqs": a.seqs, "recorded_ms": round(med["recorded"], 2),
        "eager_ms": round(med["eager"], 2), "speedup": round(med["eager"] / med["recorded"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
