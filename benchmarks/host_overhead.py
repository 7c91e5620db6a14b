"""Host time per engine step at a large decode batch, on CPU, with a model so small that the host's
Python work (schedule, input building, update + detokenization) is what gets measured.

    .venv/bin/python benchmarks/host_overhead.py --num-seqs 256 [--sampling] [--profile]

A 1-layer, 32-wide Llama of the given vocabulary (random weights, synthetic tokenizer), N prompts of
--prompt-len tokens (500), prefilled first; then the engine's own per-phase timers over --steps decode
steps (--to-end: then every request to its end), and the collector's pauses over the whole run (count,
total and longest ms a generation; gc.callbacks). --no-freeze builds the LLM without freezing its start-up
heap (foveal.engine.factory.freeze_startup_heap): the pauses without it.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--max-tokens", type=int, default=None, help="each request's (default: --steps + 40)")
    ap.add_argument("--sampling", action="store_true", help="temperature 0.6 instead of greedy")
    ap.add_argument("--profile", action="store_true", help="cProfile table of 30 more steps")
    ap.add_argument("--to-end", action="store_true", help="then run every request to its end")
    ap.add_argument("--no-freeze", action="store_true", help="build the LLM without freezing its heap")
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
    out_len = a.max_tokens or a.steps + 40
    blocks = a.num_seqs * ((a.prompt_len + out_len + 30) // 16 + 2) + 64  # every sequence fits: no preemption
    if a.no_freeze:  # the LLM as it was before it froze its start-up heap
        import foveal.engine.llm

        foveal.engine.llm.freeze_startup_heap = lambda: None
    llm = LLM(path, load_format="dummy", num_blocks=blocks, block_size=16, max_num_seqs=a.num_seqs,
              max_model_len=1024, async_scheduling=False)  # fmt: skip
    eng = llm.engine
    pauses = GcPauses().__enter__()  # over the whole run: prefill, the timed steps and the profiled ones
    g = torch.Generator().manual_seed(0)
    temp = 0.6 if a.sampling else 0.0
    for _ in range(a.num_seqs):
        ids = torch.randint(100, a.vocab, (a.prompt_len,), generator=g).tolist()
        params = SamplingParams(temperature=temp, max_tokens=out_len, ignore_eos=True)
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
    while a.to_end and eng.has_unfinished():
        eng.step()
    pauses.__exit__()
    print(f"the collector's pauses, a generation's count, total and longest ms: {pauses.summary()}")
    print(json.dumps({"benchmark": "host_overhead", "num_seqs": a.num_seqs, "sampling": a.sampling,
                      "frozen": not a.no_freeze, **ms, "gc_pauses": pauses.summary()}))  # fmt: skip


class GcPauses:
    """The collector's pauses while the block runs: {generation: [count, total ms, longest ms]}."""

    def __enter__(self):
        self.by_gen: dict[int, list[float]] = {}
        self._t0 = 0.0
        gc.callbacks.append(self._cb)
        return self

    def __exit__(self, *exc):
        if self._cb in gc.callbacks:
            gc.callbacks.remove(self._cb)
        return False

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        c = self.by_gen.setdefault(info["generation"], [0, 0.0, 0.0])
        c[0], c[1], c[2] = c[0] + 1, c[1] + ms, max(c[2], ms)

    def summary(self) -> dict:
        return {g: [c[0], round(c[1], 1), round(c[2], 1)] for g, c in sorted(self.by_gen.items())}


if __name__ == "__main__":
    main()
