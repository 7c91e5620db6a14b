"""How close the embedded model's packed GGUF weights (int8 activations) come to the dense fp32 model,
with float32 and with bfloat16 activations: the largest |log-prob difference| over the top-10 next
tokens of five prompts (and whether the top-1 agrees), and top-1 agreement teacher-forced at 20
positions of the dense model's 120-token greedy story. The reason `--dtype auto` is bf16 for packed
weights on a CPU (engine/factory.py resolve_dtype). Last line: JSON.

    python benchmarks/quant_accuracy.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal import SamplingParams  # noqa: E402
from foveal.engine.llm import LLM  # noqa: E402

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, there was a",
    "The three primary colors are",
)
STORY = "Write a short story about a robot who learns to paint."


def top10(llm, ids) -> dict[int, float]:
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=10))[0].outputs[0]
    return {t.token_id: t.logprob for t in out.logprobs[0].top}


def main() -> None:
    dense = LLM(dtype="float32", quantization="none", kv_cache_memory=64 << 20)
    ids = dense.tokenizer.encode(STORY)
    ref = dense.generate([ids], SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))[0]
    ref = ref.outputs[0].token_ids
    results = {}
    for dtype in ("float32", "bfloat16"):
        q = LLM(dtype=dtype, quantization="gguf", kv_cache_memory=64 << 20)
        worst, same = 0.0, 0
        for text in PROMPTS:
            p = dense.tokenizer.encode(text)
            a, b = top10(dense, p), top10(q, p)
            worst = max(worst, max(abs(a[k] - b[k]) for k in a.keys() & b.keys()))
            same += max(a, key=a.get) == max(b, key=b.get)
        agree = sum(
            q.generate([ids + ref[:i]], SamplingParams(temperature=0, max_tokens=1))[0]
            .outputs[0]
            .token_ids[0]
            == ref[i]
            for i in range(0, 120, 6)
        )
        results[dtype] = {
            "worst_dlogprob": round(worst, 3),
            "top1_same": same,
            "teacher_forced_agree_of_20": agree,
        }
        print(
            f"{dtype} activations: worst |dlogprob| {worst:.3f}, top-1 {same}/{len(PROMPTS)}, "
            f"teacher-forced {agree}/20"
        )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
