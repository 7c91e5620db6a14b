"""A prompt's prefill on the CPU, the embedded SmolLM2 (GGUF Q4_1, bf16) as `foveal serve` runs it: the
`cpu` attention backend (every row in the native kernel, attention/cpu_attention.c) against the
`torch` one (SDPA for prompt chunks), two engines in one process taking turns, so this host's drift
hits both alike. Each prompt runs alone with one output token and the prefix cache off; the figure is
the best of `--reps` turns. `--budget`: tokens per step (`foveal serve` on a CPU takes 128: a long
prompt then runs in chunks, each attending to the cached ones before it; offline, 2048).

    python benchmarks/cpu_prefill.py [--lengths 160 700 1300 2000] [--reps 3] [--budget 128]
    python benchmarks/cpu_prefill.py --hit-miss   # not a timing: six chat turns sharing a system prompt,
        greedy with logprobs, one at a time with the prefix cache on (later turns hit) and off, with each
        backend: how many answers agree and the largest logprob difference before they part

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

TEXT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 300)


def hit_miss() -> None:
    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    questions = ("Name a color.", "Name a fruit.", "What is 2+2?", "Name a color.", "Name three colors.",
                 "Tell a short joke.")  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=1)
    out = {}
    for backend in ("cpu", "torch"):
        runs = []
        for caching in (True, False):
            llm = LLM(attention_backend=backend, enable_prefix_caching=caching, kv_cache_memory=64 * 2**20)
            turns = [[system, {"role": "user", "content": q}] for q in questions]
            runs.append([llm.chat(t, params)[0].outputs[0] for t in turns])
        same, diff = 0, 0.0
        for hit, miss in zip(*runs):
            same += hit.token_ids == miss.token_ids
            for a, b in zip(hit.logprobs, miss.logprobs):
                if a.token_id != b.token_id:
                    break
                diff = max(diff, abs(a.logprob - b.logprob))
        out[backend] = {"same_answers": same, "answers": len(questions), "max_logprob_diff": diff}
        print(f"{backend:>6}: {same} of {len(questions)} answers the same hit or miss; "
              f"logprobs up to {diff:.3g} apart before they part")  # fmt: skip
    print(json.dumps({"benchmark": "cpu_prefill", "hit_miss": out}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[160, 700, 1300, 2000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--hit-miss", action="store_true", help="answers with the prefix cache on and off")
    a = ap.parse_args()
    if a.hit_miss:
        return hit_miss()
    engines = {
        b: LLM(attention_backend=b, enable_prefix_caching=False, max_num_batched_tokens=a.budget)
        for b in ("cpu", "torch")
    }
    ids = engines["cpu"].tokenizer.encode(TEXT)
    one = SamplingParams(temperature=0, max_tokens=1)
    results = []
    for n in a.lengths:
        prompt = ids[:n]
        best = {b: float("inf") for b in engines}
        for _ in range(a.reps):
            for b, llm in engines.items():
                t = time.perf_counter()
                llm.generate([prompt], one)
                best[b] = min(best[b], time.perf_counter() - t)
        results.append({"tokens": n, "cpu_s": round(best["cpu"], 4), "torch_s": round(best["torch"], 4)})
    print(f"{'prompt tokens':>14}{'cpu s':>10}{'torch s':>10}{'cpu / torch':>13}")
    for r in results:
        r["ratio"] = round(r["cpu_s"] / r["torch_s"], 3)
        print(f"{r['tokens']:>14}{r['cpu_s']:>10.4f}{r['torch_s']:>10.4f}{r['ratio']:>13.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    summary = {"benchmark": "cpu_prefill", "commit": commit.strip(), "budget": a.budget, "results": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
