"""Closing before max_tokens (foveal/structured/closing.py): how often a plan is found, and what it costs.

For every --every'th maskbench schema the backend accepts, three random walks under its grammar mask
(5, 30 and 300 one-byte tokens, biased towards `"`, `]` and `}` as the end-to-end test's requests are),
then the plan from that point: found or not, its length in tokens, the host time it took, and whether
the completed document validates with jsonschema. Over the tiny tests' byte tokenizer or the embedded
SmolLM2's (49,152 tokens).

    python benchmarks/closing.py --tokenizer byte
    python benchmarks/closing.py --tokenizer smollm2 --every 2
    python benchmarks/closing.py --budget none     # the search without the model thread's budget

`--budget default` (the default) plans as the server does, each plan on closing.Budget's limits (a
plan over them is given up: counted in "given_up"); `none` lets every search run to its end.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from foveal.structured import OutputConstraint, closing  # noqa: E402
from foveal.structured.closing import nesting, prepare  # noqa: E402
from foveal.structured.llguidance_backend import LLGuidanceBackend  # noqa: E402
from tests.test_closing import random_point  # noqa: E402

MASKBENCH = HERE.parent.parent / "shared" / "heldout" / "jsonschemabench" / "maskbench_sample.jsonl"


def tokenizer(name: str):
    if name == "byte":
        from tests.tiny_vlm import byte_tokenizer

        return byte_tokenizer([], "")
    from transformers import AutoTokenizer

    from foveal.loader.default_model import default_model_path

    folder, file = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(folder, gguf_file=file)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", choices=("byte", "smollm2"), default="byte")
    ap.add_argument("--every", type=int, default=1, help="every n-th schema of the sample")
    ap.add_argument("--limit", type=int, default=8000, help="the plan's token budget")
    ap.add_argument("--schemas", default=str(MASKBENCH))
    ap.add_argument("--budget", choices=("default", "none"), default="default")
    ap.add_argument("--budget-ms", type=float, default=None, help="a plan's and a step's time limit instead")
    args = ap.parse_args()
    if args.budget == "none":
        closing.BUDGET = closing.Budget(3600.0, 10**12, 3600.0)
        closing.WITNESS_SECONDS = 3600.0
    elif args.budget_ms is not None:
        closing.BUDGET = closing.Budget(args.budget_ms / 1e3, closing.PLAN_EXPANSIONS, args.budget_ms / 1e3)
    import jsonschema

    backend = LLGuidanceBackend.from_tokenizer(tokenizer(args.tokenizer))
    rows = [json.loads(line) for line in Path(args.schemas).read_text().splitlines()][:: args.every]
    found, invalid, missing, seconds, lengths, points = 0, 0, [], [], [], 0
    for r in rows:
        try:
            g = backend.compile(OutputConstraint.json_schema(r["schema"]))
        except ValueError:
            continue
        closer = prepare(g)
        for seed, steps in enumerate((5, 30, 300)):
            m, out = random_point(backend, g, seed, steps)
            points += 1
            closing.BUDGET.new_step()  # one plan a step, as a request's look
            t0 = time.perf_counter()
            plan = closer.plan(m, nesting("", backend.token_bytes(out)), args.limit)
            seconds.append(time.perf_counter() - t0)
            if plan is None:
                missing.append(r["id"])
                continue
            found += 1
            lengths.append(len(plan))
            if not m.accept(plan):  # a plan the grammar refuses is as wrong as an invalid document
                invalid += 1
                continue
            try:
                jsonschema.validate(json.loads(backend.token_bytes(out + plan)), r["schema"])
            except Exception:
                invalid += 1
    seconds.sort()
    lengths.sort()

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))]

    result = {
        "tokenizer": args.tokenizer,
        "points": points,
        "plans_found": found,
        "plans_invalid": invalid,
        "budget": args.budget if args.budget_ms is None else f"{args.budget_ms:g} ms",
        "given_up": closing.BUDGET.skipped,
        "no_plan": sorted(set(missing)),
        "plan_ms": {"p50": q(seconds, 0.5) * 1e3, "p90": q(seconds, 0.9) * 1e3, "max": seconds[-1] * 1e3},
        "plan_tokens": {"p50": q(lengths, 0.5), "p90": q(lengths, 0.9), "max": lengths[-1]},
    }
    print(
        f"{found} of {points} points closed ({invalid} invalid; {closing.BUDGET.skipped} plans given up over "
        f"the budget); no plan: {result['no_plan']}"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
