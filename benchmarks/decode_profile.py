"""Decode-step time of Foveal on a SmolLM2-135M-shaped random model (32 sequences x 128-token prompts),
through the scheduler and paged cache without a tokenizer; `--profile` adds a cProfile table.

    python benchmarks/decode_profile.py --dtype bfloat16 [--profile] [--attention-backend torch|cpu|both]

`--attention-backend both` alternates the torch and cpu backends step by step in one process (same
sequences, same cache) and reports each one's median decode step: an A/B that this host's drift
(+-15% between runs) cannot bias.

The prompts are prefilled in steps of `--budget` tokens (default 8192: one step for 32 prompts); each
prefill step's time and minor page faults are printed. `--keep-freed-memory` first sets glibc's malloc to
keep freed memory (mmap threshold 32 MiB, trim threshold 1 GiB), the A/B of a change tried and dropped
in session 5 (benchmarks/RESULTS.md): fewer page faults and faster prefill, slower decode steps.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import json
import os
import pstats
import resource
import sys
import time

import torch
import transformers as tf

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal.attention import get_backend  # noqa: E402
from tests.tiny import Harness  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--budget", type=int, default=8192, help="prefill tokens per step")
    ap.add_argument("--keep-freed-memory", action="store_true", help="glibc mallopt: keep freed memory")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--attention-backend", default="torch", choices=["torch", "cpu", "both"])
    a = ap.parse_args()
    cfg = tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    cfg.architectures = ["LlamaForCausalLM"]
    if a.keep_freed_memory:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MiB from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: keep up to 1 GiB of freed heap
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(cfg)
    names = ["torch", "cpu"] if a.attention_backend == "both" else [a.attention_backend]
    h = Harness(
        hf,
        num_blocks=1200,
        block_size=16,
        budget=a.budget,
        max_num_seqs=256,
        dtype=getattr(torch, a.dtype),
        backend=names[0],
    )
    backends = {n: get_backend(n, "cpu") for n in names}
    for i in range(a.batch):
        h.add(f"r{i}", torch.randint(100, 49000, (128,)).tolist(), max_tokens=1000)

    def step():
        batch = h.sched.schedule()
        out = h.runner.execute(batch)
        h.sched.update(batch, out.tokens)

    prefill_steps = []  # (seconds, minor page faults) per step until every prompt is prefilled
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in [*h.sched.waiting, *h.sched.running]):
        f0, t = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        step()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
        prefill_steps.append((round(time.perf_counter() - t, 2), faults))
    prefill = sum(s for s, _ in prefill_steps)
    times = {n: [] for n in names}
    for i in range(a.steps * len(names)):
        name = names[i % len(names)]
        h.use_backend(backends[name])
        t = time.perf_counter()
        step()
        times[name].append(time.perf_counter() - t)
    medians = {n: sorted(ts)[len(ts) // 2] for n, ts in times.items()}
    med = medians[names[-1]]
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    by_backend = {n: round(m * 1e3, 1) for n, m in medians.items()}
    print(f"prefill {a.batch}x128: {prefill:.2f} s in steps (s, page faults) {prefill_steps}; "
          f"decode step median (ms) by attention backend {by_backend}")  # fmt: skip
    print(json.dumps({"benchmark": "decode_profile", "dtype": a.dtype, "batch": a.batch, "budget": a.budget,
                      "keep_freed_memory": a.keep_freed_memory, "prefill_s": round(prefill, 2),
                      "prefill_steps": prefill_steps, "decode_step_ms": round(med * 1e3, 1),
                      "decode_step_ms_by_backend": by_backend}))  # fmt: skip


if __name__ == "__main__":
    main()
