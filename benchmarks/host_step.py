"""Host time of the engine's step phases at many decode rows: a tiny random Qwen3 on CPU (the model's
compute is small, so what shows is the scheduler's and runner's Python per row), 256 requests decoding,
60 steps timed after the prefills; `Scheduler.schedule` and `advance` are timed by wrapping them.

    python benchmarks/host_step.py [--rows 256] [--steps 60] [--mixed] [--prompt-max 1024] [--profile N]

The engine's and runner's phases are timed by wrapping them too: the runner's launch (rows built, the
model run) and sample, the engine's _resolve (collect, the scheduler's resolve, the emit path) and
_emit (detokenization and the deltas) alone. --prompt-max 32: short prompts, so the CPU's attention
does not swamp the host's work.

--mixed: every row with its own sampling parameters as benchmarks/sampling.py's mixed workload
(temperatures, top_p / top_k / min_p, penalties, seeds on half, logprobs on a quarter); else
temperature 0.6 on every row (nano-vllm's workload, W3).

--profile N: after the timed steps, a cProfile table (the N functions of most own time) of as many more.

Run it from another checkout's root (PYTHONPATH=that root) for a before/after; alternate the runs.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--prompt-max", type=int, default=1024, help="longest prompt (uniform lengths)")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions of most own time")
    a = ap.parse_args()
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                      architectures=["Qwen3ForCausalLM"])  # fmt: skip
    path = os.path.join(tempfile.mkdtemp(), "config.json")
    with open(path, "w") as f:
        f.write(cfg.to_json_string())
    llm = LLM(path, load_format="dummy", dtype="float32", max_model_len=4096, max_num_seqs=a.rows,
              max_num_batched_tokens=16384, num_blocks=20000, block_size=16)  # fmt: skip
    eng, sch = llm.engine, llm.engine.scheduler
    rng = random.Random(0)
    extra = a.steps if a.profile else 0
    if a.mixed:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sampling import mixed_params

        per_row = mixed_params(a.rows, a.steps + extra + 40)
    else:
        per_row = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=a.steps + extra + 40)] * a.rows
    for params in per_row:
        ids = [rng.randint(0, 999) for _ in range(rng.randint(min(100, a.prompt_max), a.prompt_max))]
        eng.add_request(llm.processor.request(ids, params))
    while sch.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sch.running):
        eng.step()
    for _ in range(5):
        eng.step()
    spent = {"schedule": 0.0, "advance": 0.0, "launch": 0.0, "sample": 0.0, "resolve": 0.0, "emit": 0.0}

    def timed(name, fn):
        def call(*args, **kw):
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            spent[name] += time.perf_counter() - t0
            return out

        return call

    sch.schedule, sch.advance = timed("schedule", sch.schedule), timed("advance", sch.advance)
    run = eng.runner
    run.launch, run.sample = timed("launch", run.launch), timed("sample", run.sample)
    eng._resolve, eng._emit = timed("resolve", eng._resolve), timed("emit", eng._emit)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    step = (time.perf_counter() - t0) / a.steps
    res = {"benchmark": "host_step", "rows": a.rows, "mixed": a.mixed, "step_ms": round(step * 1e3, 2)}
    res.update({f"{k}_ms": round(v / a.steps * 1e3, 3) for k, v in spent.items()})
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(lambda: [eng.step() for _ in range(a.steps)])
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(a.profile)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
