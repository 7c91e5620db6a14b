"""Host time per engine step at a large decode batch, on CPU, with a model so small that the host's
Python work (schedule, input building, update + detokenization) is what gets measured.

    .venv/bin/python benchmarks/host_overhead.py --num-seqs 256 [--sampling] [--profile]

A 1-layer, 32-wide Llama of the given vocabulary (random weights, synthetic tokenizer), N prompts of
500 tokens, prefilled first; then the engine's own per-phase timers over --steps decode steps.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sampling", action="store_true", help="temperature 0.6 instead of greedy")
    ap.add_argument("--profile", action="store_true", help="cProfile table of 30 more steps")
    a = ap.parse_args()
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    path = os.path.join(tempfile.mkdtemp(), "host-overhead.json")
    with open(path, "w") as f:
        f.write(cfg.to_json_string())
    blocks = a.num_seqs * ((500 + a.steps + 40 + 30) // 16 + 2) + 64  # every sequence fits: no preemption
    llm = LLM(path, load_format="dummy", num_blocks=blocks, block_size=16, max_num_seqs=a.num_seqs,
              max_model_len=1024, async_scheduling=False)  # fmt: skip
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    temp = 0.6 if a.sampling else 0.0
    for _ in range(a.num_seqs):
        ids = torch.randint(100, a.vocab, (500,), generator=g).tolist()
        params = SamplingParams(temperature=temp, max_tokens=a.steps + 40, ignore_eos=True)
        eng.add_request(llm.processor.request(ids, params))
    while eng.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    for k in ("schedule", "execute", "update"):
        eng.step_seconds[k] = 0.0
    eng.step_seconds["steps"] = 0
    for _ in range(a.steps):
        eng.step()
    n = eng.step_seconds["steps"]
    ms = {k: round(eng.step_seconds[k] / n * 1e3, 3) for k in ("schedule", "execute", "update")}
    print(f"{eng.num_running} running sequences, ms per step: {ms}")
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(30):
            eng.step()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    print(json.dumps({"benchmark": "host_overhead", "num_seqs": a.num_seqs, "sampling": a.sampling, **ms}))


if __name__ == "__main__":
    main()
