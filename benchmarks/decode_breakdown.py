"""Where one CPU decode step's time goes, at a few rows (default 1: a single stream), on the embedded
model with the engine's defaults (`--args` adds LLM keywords as JSON). The prompts (128 random words
each) are prefilled, then `--steps` decode steps are timed as `Engine.step()` wall time, split into the
recorded model step's replay (worker/cpu_graphs.py: each native call and tensor op timed on its own,
summed per callee) and everything else in the step (scheduling, sampling, stop checks, detokenizing,
Python). Medians per step, in microseconds; the callees' sums are per step too. Last line: JSON.

    python benchmarks/decode_breakdown.py [--rows 1] [--steps 200] [--args '{"dtype": "bfloat16"}']
    python benchmarks/decode_breakdown.py --prefill 8     # 128-token prefills instead (serving budget)

`--prefill N`: N prompts of 128 random words prefilled one at a time with the server's CPU budget (128
tokens per step), each timed whole (one token sampled), the native kernels timed per callee; the first
prefill is left out.

`--qlinear avx2`: the quantized linears run the AVX2-only build of their kernel (-DFOVEAL_AVX2_ONLY: what
a CPU without AVX-512 and VNNI runs) instead of this CPU's build, to compare the two in the model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams, native  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402
from foveal.worker import cpu_graphs  # noqa: E402

WORDS = "time person year way day thing man world life hand part child eye woman place work week case".split()


def callee(fn) -> str:
    name = getattr(fn, "__name__", None) or str(fn)
    return name.replace("aten::", "").replace("aten.", "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--args", default="{}", help="LLM keywords as JSON")
    ap.add_argument("--prefill", type=int, default=0, help="time N 128-token prefills instead")
    ap.add_argument("--qlinear", choices=["native", "avx2"], default="native", help="the kernel build")
    a = ap.parse_args()
    if a.qlinear == "avx2":  # before the model is built: its recorded steps call the kernel looked up
        from foveal.layers import quant

        avx2 = quant.build(wide=False)
        quant.kernel = lambda: avx2
    if a.prefill:
        return prefills(a)
    llm = LLM(**json.loads(a.args))
    engine = llm.engine
    rng = random.Random(0)
    per_callee: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    replay_s = [0.0]
    counting = [False]
    real_replay = cpu_graphs.replay

    def timed_replay(tape):
        if not counting[0]:
            return real_replay(tape)
        t_all = time.perf_counter()
        for entry in tape:
            t = time.perf_counter()
            real_replay([entry])
            if entry[0] is not None:
                name = callee(entry[0])
                per_callee[name] += time.perf_counter() - t
                calls[name] += 1
        replay_s[0] += time.perf_counter() - t_all

    cpu_graphs.replay = timed_replay
    params = SamplingParams(temperature=0, max_tokens=a.steps + 40, ignore_eos=True)
    for _ in range(a.rows):
        text = " ".join(rng.choice(WORDS) for _ in range(128))
        engine.add_request(llm.processor.request(text, params))
    while engine.num_waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # prefills, and the first decode steps (the recording)
    for _ in range(10):
        engine.step()
    steps, replays = [], []
    counting[0] = True
    for _ in range(a.steps):
        replay_s[0] = 0.0
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        replays.append(replay_s[0])
    counting[0] = False
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    med = statistics.median
    step_us, replay_us = med(steps) * 1e6, med(replays) * 1e6
    n = a.steps
    print(
        f"rows {a.rows}: step {step_us:.0f} us (median of {n}), recorded model step {replay_us:.0f} us, "
        f"the rest {step_us - replay_us:.0f} us; {1e6 / step_us * a.rows:.1f} tok/s"
    )
    top = per_callee.most_common(14)
    for name, s in top:
        print(f"  {s / n * 1e6:8.1f} us/step  {calls[name] // n:4d} calls  {name}")
    print(
        json.dumps(
            {
                "rows": a.rows,
                "steps": n,
                "args": json.loads(a.args),
                "step_us": round(step_us, 1),
                "replay_us": round(replay_us, 1),
                "rest_us": round(step_us - replay_us, 1),
                "callees_us_per_step": {k: round(v / n * 1e6, 1) for k, v in top},
            }
        )
    )


def prefills(a) -> None:
    llm = LLM(**{"max_num_batched_tokens": 128, **json.loads(a.args)})
    rng = random.Random(0)
    per: collections.Counter = collections.Counter()
    counting = [False]
    real_call = native.Entry.__call__

    def timed(self, *args):
        t = time.perf_counter()
        real_call(self, *args)
        if counting[0]:
            per[self.fn.__name__] += time.perf_counter() - t

    native.Entry.__call__ = timed
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for i in range(a.prefill + 1):
        llm.engine.add_request(llm.processor.request(" ".join(rng.choice(WORDS) for _ in range(128)), params))
        counting[0] = i > 0
        t = time.perf_counter()
        while llm.engine.has_unfinished():
            llm.engine.step()
        if i:
            times.append(time.perf_counter() - t)
    n = len(times)
    med = statistics.median(times) * 1e3
    print(f"128-token prefill: {med:.1f} ms (median of {n}), native kernels per prefill:")
    for name, s_ in per.most_common(8):
        print(f"  {s_ / n * 1e3:8.1f} ms  {name}")
    print(
        json.dumps(
            {"prefill_ms": round(med, 1), "native_ms": {k: round(v / n * 1e3, 1) for k, v in per.items()}}
        )
    )


if __name__ == "__main__":
    main()
