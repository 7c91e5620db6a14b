"""What a workload's first run pays that later runs do not: W4's engine (Qwen2.5-VL-7B, dummy weights)
with gpu_workloads.py's warm-up (1, 1, then 4 image requests), then its 64 concurrent image requests
(448x448 + 64 tokens, 128 out) for several rounds, other images each round.

    python3 benchmarks/first_use.py [--rounds 3] [--timed-rounds 2] [--compiles] [--smoke]

The first --timed-rounds rounds synchronize around each engine step and print the first steps' times;
the later ones run as gpu_workloads.py does. --compiles: a fresh Triton cache (every kernel variant
compiles for real) and the compiles listed by phase (engine start, warm-up, each round) with their
constants, times and arguments' specialization (Triton's jit_cache_hook / jit_post_compile_hook; the
start's attention decode and combine compiles are listed too, to compare with later ones). --smoke:
the CPU and a tiny config (checks the script; no compiles there: Triton's interpreter). Ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timed-rounds", type=int, default=2)
    ap.add_argument("--compiles", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.compiles:  # before triton is imported: its cache directory is read then
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="foveal-triton-cache-")
    sys.path.insert(0, HERE)
    import gpu_workloads as g
    import torch

    phase = ["start"]
    compiles: list[tuple[str, str, float, str, str]] = []
    if a.compiles:
        import triton

        began: dict = {}

        def before(**kw):
            began[kw["key"]] = time.perf_counter()

        def after(**kw):
            spent = time.perf_counter() - began.pop(kw["key"], time.perf_counter())
            # repr: each argument's type with Triton's specialization (D: divisible by 16, 1: a constant)
            compiles.append(
                (phase[0], kw["fn"].name, spent, str(kw["compile"].get("constants"))[:300], kw["repr"])
            )

        triton.knobs.runtime.jit_cache_hook = before
        triton.knobs.runtime.jit_post_compile_hook = after
    opts = argparse.Namespace(
        enforce_eager=False, async_scheduling="auto", gpu_memory_utilization=0.9, smoke=a.smoke
    )
    g.setup(opts, "first_use.py")
    llm, image_prompt = g.w4_engine(opts)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    phase[0] = "warm-up"
    g.w4_warm_up(llm, image_prompt)
    eng = llm.engine
    step = eng.step
    times: list[float] = []

    def timed_step():
        sync()
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        return out

    out = {}
    n = g.N(64)
    for rnd in range(a.rounds):
        phase[0] = f"round {rnd}"
        prompts = [image_prompt(rnd * 100 + i) for i in range(1, n + 1)]
        eng.step = timed_step if rnd < a.timed_rounds else step
        times.clear()
        r = g.run(llm, prompts, [g.greedy(g.L(128))] * n)
        eng.step = step
        extra = f"first steps (ms, synchronized): {[round(t, 1) for t in times[:6]]}" if times else ""
        g.report(f"W4 64 concurrent, round {rnd}", r, extra)
        out[f"round_{rnd}"] = {**r, "first_steps_ms": [round(t, 2) for t in times[:6]]}
    if a.compiles:
        by = collections.defaultdict(lambda: [0, 0.0])
        for ph, _, spent, *_ in compiles:
            by[ph][0] += 1
            by[ph][1] += spent
        g.log(
            "Triton compiles by phase (count, seconds): "
            + str({k: (v[0], round(v[1], 2)) for k, v in by.items()})
        )
        for ph, name, spent, consts, spec in compiles:
            if ph != "start" or name in ("_decode_kernel", "_combine_kernel"):
                g.log(f"  {ph}: {name} {spent * 1e3:.0f} ms {consts}\n    {spec}")
        out["compiles"] = {k: {"count": v[0], "seconds": round(v[1], 3)} for k, v in by.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
