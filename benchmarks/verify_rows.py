"""Host time to build a verify step's inputs: `build_rows` (worker/rows.py) and the Triton backend's
graph metadata for it (`shares_prefixes`, `fill_graph_metadata`), at B requests of 1 + k rows each (a
verify run's rows; a DFlash block step has 1 + k + block rows a request), on CPU tensors. The rest of
the step (the model, sampling) is left out: this is the host part that runs before the verify
step's graph can be launched. `--rows 1 --requests 256`: a plain decode step.

A request's table is one tuple from step to step until its blocks change; `--renew F`: at each call
a fraction F of the requests get a fresh tuple (a decode step appends a block to 1 in 16 of them).

    python benchmarks/verify_rows.py [--requests 64] [--rows 5,16] [--context 700] [--reps 300]

`--against DIR`: DIR's foveal/attention/triton_backend.py (another tree: `git archive <commit> foveal |
tar -x -C DIR`) loaded beside this one in the same process, the two alternating round by round (the
host's speed moves more across processes than a change does): shares_prefixes + fill_graph_metadata at
each --rows, and plan() of a mixed step (100 decode rows of 100-1,500 keys, 30 prompt chunks of 512).

Ends with one JSON line (milliseconds per call, the median of --rounds rounds of --reps calls).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from foveal.attention import triton_backend  # noqa: E402
from foveal.attention.base import AttentionBatch  # noqa: E402
from foveal.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from foveal.sched.batch import DEVICE_DRAFT, ScheduledItem  # noqa: E402
from foveal.worker.rows import build_rows  # noqa: E402


def verify_items(requests: int, rows: int, context: int, bs: int):
    """Verify items of `rows` rows each (the last token and rows - 1 drafts staged on the device)."""
    items, held = [], {}
    for r in range(requests):
        rid = f"r{r}"
        blocks = -(-(context + rows) // bs)
        table = tuple(range(r * (blocks + 1), r * (blocks + 1) + blocks))
        k = rows - 1
        items.append(
            ScheduledItem(rid, context, (5,) + (DEVICE_DRAFT,) * k, table, num_logits=rows, num_drafts=k)
        )
        held[rid] = SimpleNamespace(slot=r, shift=0, req=SimpleNamespace(prompt_token_ids=[1] * 512))
    return items, held


class Renewed:
    """Called once a step: the next `fraction` of the requests (in turn) get a fresh copy of their
    table, in each of their `rows` rows (they share it)."""

    def __init__(self, tables: list, rows: int, fraction: float):
        self.tables, self.rows, self.next = tables, rows, 0
        self.count = round(len(tables) // rows * fraction)

    def __call__(self) -> None:
        requests = len(self.tables) // self.rows
        for _ in range(self.count):
            r, self.next = self.next, (self.next + 1) % requests
            t = tuple(self.tables[r * self.rows])
            self.tables[r * self.rows : (r + 1) * self.rows] = [t] * self.rows


def timed(fn, reps: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out.append((time.perf_counter() - t0) / reps * 1e3)
    return round(statistics.median(out), 3)


def side_by_side(fns: dict, reps: int, rounds: int) -> dict:
    """Median ms per call of each fn, the fns taking turns round by round."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    times: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[k].append((time.perf_counter() - t0) / reps * 1e3)
    return {k: round(statistics.median(v), 3) for k, v in times.items()}


def backend_module(root: str):
    """root's foveal/attention/triton_backend.py as a module of its own (its imports: this tree's)."""
    name = "triton_backend_of_" + os.path.basename(os.path.abspath(root))
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(root, "foveal/attention/triton_backend.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def against(a, bs: int) -> None:
    """This tree's Triton backend and --against's, alternating (see the module doc)."""
    mods = {"this": triton_backend, "against": backend_module(a.against)}
    out = {"benchmark": "verify_rows_against", "against": a.against, "rows": []}
    for rows in (int(x) for x in a.rows.split(",")):
        items, held = verify_items(a.requests, rows, a.context, bs)
        n = a.requests * rows
        step = build_rows(items, held, rows + 1, bs)
        fns = {}
        for key, mod in mods.items():
            backend = mod.TritonAttentionBackend()
            static = backend.graph_metadata(n, -(-(a.context + rows) // bs) + 1, bs, "cpu")
            batch = AttentionBatch(step.query_lens, step.context_lens, list(step.block_tables), n, None, bs)
            renewed = Renewed(batch.block_tables, rows, a.renew)

            def call(backend=backend, static=static, batch=batch, renewed=renewed, n=n):
                backend._memo = None
                renewed()
                backend.shares_prefixes(batch)
                backend.fill_graph_metadata(static, batch, n)

            fns[key] = call
        row = {
            "requests": a.requests,
            "rows": rows,
            "shares_and_fill_ms": side_by_side(fns, a.reps, a.rounds),
        }
        print(json.dumps(row), flush=True)
        out["rows"].append(row)
    rng = random.Random(0)
    tables, ctxs, q_lens = [], [], []
    for i in range(130):  # 100 decode rows, then 30 prompt chunks of 512 from position 0
        c, q = (rng.randint(100, 1500), 1) if i < 100 else (0, 512)
        tables.append(tuple(rng.sample(range(50000), (c + q) // bs + 1)))
        ctxs.append(c)
        q_lens.append(q)
    fns = {}
    for key, mod in mods.items():
        backend, batch = (
            mod.TritonAttentionBackend(),
            AttentionBatch(q_lens, ctxs, list(tables), 100, None, bs),
        )

        def plan(backend=backend, batch=batch):
            backend._memo = None
            backend.plan(batch, "cpu")

        fns[key] = plan
    out["mixed_plan_ms"] = side_by_side(fns, a.reps, a.rounds)
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument(
        "--rows", default="5,16", help="rows a request (1 + k; a DFlash block step: 1 + k + block)"
    )
    ap.add_argument("--context", type=int, default=700, help="keys before each request's first row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--renew", type=float, default=1 / 16, help="requests with a new table each call")
    ap.add_argument("--against", default=None, help="another tree's root: its Triton backend side by side")
    a = ap.parse_args()
    bs, results = a.block_size, []
    if a.against:
        return against(a, bs)
    for rows in (int(x) for x in a.rows.split(",")):
        items, held = verify_items(a.requests, rows, a.context, bs)
        n = a.requests * rows
        backend = TritonAttentionBackend()
        static = backend.graph_metadata(n, -(-(a.context + rows) // bs) + 1, bs, "cpu")
        step = build_rows(items, held, rows + 1, bs)
        batch = AttentionBatch(step.query_lens, step.context_lens, step.block_tables, step.num_rows, None, bs)

        def rows_of(items=items, held=held, width=rows + 1):
            build_rows(items, held, width, bs)

        renewed = Renewed(batch.block_tables, rows, a.renew)

        def shares(batch=batch, backend=backend, renewed=renewed):
            backend._memo = None  # planned afresh, as for each new step
            renewed()
            backend.shares_prefixes(batch)

        def fill(batch=batch, backend=backend, static=static, n=n, renewed=renewed):
            backend._memo = None
            renewed()
            backend.fill_graph_metadata(static, batch, n)

        row = {"requests": a.requests, "rows": rows, "context": a.context,
               "build_rows_ms": timed(rows_of, a.reps, a.rounds),
               "shares_prefixes_ms": timed(shares, a.reps, a.rounds),
               "fill_graph_metadata_ms": timed(fill, a.reps, a.rounds)}  # fmt: skip
        print(json.dumps(row), flush=True)
        results.append(row)
    print(json.dumps({"benchmark": "verify_rows", "rows": results}))


if __name__ == "__main__":
    main()
