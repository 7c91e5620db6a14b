"""Host cost of the Triton backend's shared-prefix grouping (no GPU needed: metadata on CPU tensors).

A decode batch of `--rows` rows with `--blocks`-block tables, block size 16: the median over `--calls`
calls of (a) shares_prefixes() on a batch with no block in common (the check every graph step pays),
(b) the plain graph fill, (c) shares_prefixes() + the fill with groups on a batch whose rows share their
first 3 blocks (what a grouped graph step pays); with a request's own rows grouping on (speculation's
verify rows: request_min_prefix 256 keys, steps with >= 32 such requests): (d) the check on the plain
batch, (e) the check + the grouped fill on a batch of rows / 4 requests of 4 verify rows each.

    python benchmarks/shared_prefix_host.py [--rows 256] [--blocks 40] [--calls 200]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.getcwd())

from foveal.attention.base import AttentionBatch  # noqa: E402
from foveal.attention.triton_backend import TritonAttentionBackend  # noqa: E402


def median_us(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=40)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    n, bs = a.rows, 16
    g = np.random.default_rng(0)
    own = [g.choice(np.arange(10, 10**6), a.blocks, replace=False).tolist() for _ in range(n)]
    shared = [[1, 2, 3] + t[3:] for t in own]
    ctx = [a.blocks * bs - 8] * n
    backend = TritonAttentionBackend(shared_min_rows=64, shared_min_prefix=16)
    static = backend.graph_metadata(n, a.blocks + 1, bs, "cpu")

    def batch(tables):  # a new batch each call, as each step brings one
        return AttentionBatch([1] * n, ctx, tables, n, None, bs)

    def grouped():
        b = batch(shared)
        assert backend.shares_prefixes(b)
        backend.fill_graph_metadata(static, b, n, shared=True)

    res = {
        "check_no_sharing_us": median_us(lambda: backend.shares_prefixes(batch(own)), a.calls),
        "plain_fill_us": median_us(lambda: backend.fill_graph_metadata(static, batch(own), n), a.calls),
        "grouped_check_and_fill_us": median_us(grouped, a.calls),
    }
    backend.request_min_prefix = 256
    verify = [own[i // 4] for i in range(n)]  # 4 rows a request, one table (the same list, as a step has)
    verify_ctx = [ctx[0] - 3 + i % 4 for i in range(n)]

    def verify_step():
        b = AttentionBatch([1] * n, verify_ctx, verify, n, None, bs)
        assert backend.shares_prefixes(b)
        backend.fill_graph_metadata(static, b, n, shared=True)

    res["request_rows_check_no_sharing_us"] = median_us(lambda: backend.shares_prefixes(batch(own)), a.calls)
    res["request_rows_check_and_fill_us"] = median_us(verify_step, a.calls)
    for k, v in res.items():
        print(f"{k}: {v:.1f}")
    print(json.dumps({"benchmark": "shared_prefix_host", "rows": n, "blocks": a.blocks, **res}))


if __name__ == "__main__":
    main()
