"""Fuzzing the constraint layer of a live `foveal serve` (issue 34): hypothesis draws hostile regexes,
JSON schemas, Lark grammars and choice lists (deep repetition bounds, wide alternations, long rule
chains, deep nesting, big minLength, garbage text) and posts each as a /v1/completions constraint,
while a bystander chat stream decodes without pause (a new one as each ends). Reported: cases, status
codes, 5xx (the run fails on any), whether the server is alive at the end, and the bystander's largest
gap between tokens, and its p99.

    python benchmarks/fuzz_grammars.py [--cases 2000] [--seed 0] [--port 8791] [--args "--max-num-seqs 16"]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import threading
import time

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# -- strategies ---------------------------------------------------------------------------------------
ATOM = st.sampled_from(["a", "b", ".", "\\d", "[a-z]", "[^x]", "\\w", "(?:ab)", "x|y", "\\(", "é"])
BOUND = st.one_of(st.integers(0, 12), st.integers(0, 2_000_000))


def _repeat(inner):
    return st.builds(
        lambda r, lo, hi, kind: (
            f"(?:{r}){{{lo}}}" if kind == 0 else f"(?:{r}){{{lo},}}" if kind == 1
            else f"(?:{r}){{{min(lo, hi)},{max(lo, hi)}}}" if kind == 2 else f"(?:{r}){'*+?'[kind - 3]}"
        ),
        inner, BOUND, BOUND, st.integers(0, 5),
    )  # fmt: skip


REGEX = st.recursive(
    ATOM,
    lambda inner: st.one_of(
        _repeat(inner),
        st.lists(inner, min_size=2, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=4).map(lambda xs: "(" + "|".join(xs) + ")"),
    ),
    max_leaves=12,
)
GARBAGE = st.text(st.characters(codec="utf-8"), max_size=200)


def _schema_leaf():
    return st.one_of(
        st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": max(lo, hi)}, BOUND, BOUND),
        st.builds(lambda p: {"type": "string", "pattern": p}, REGEX),
        st.builds(lambda n: {"enum": [f"v{i}" for i in range(n)]}, st.integers(1, 5000)),
        st.builds(lambda lo: {"type": "array", "minItems": lo, "items": {"type": "integer"}}, BOUND),
        st.just({"type": "integer", "minimum": 10**30}),
        st.just({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        st.just({"type": "number", "multipleOf": 1e-300}),
        st.builds(
            lambda f: {"type": "string", "format": f}, st.sampled_from(["date-time", "email", "uri", "x"])
        ),
    )


SCHEMA = st.recursive(
    _schema_leaf(),
    lambda inner: st.one_of(
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=4)),
        # wide, of a leaf (of `inner` the JSON would grow as 3000^depth: the driver ran out of memory)
        st.builds(lambda n, x: {"anyOf": [x] * n}, st.integers(1, 3000), _schema_leaf()),
        st.builds(
            lambda props: {"type": "object", "properties": props, "required": list(props)},
            st.dictionaries(st.text("abcdef", min_size=1, max_size=4), inner, max_size=4),
        ),
        st.builds(lambda x: {"type": "array", "items": x, "maxItems": 3}, inner),
    ),
    max_leaves=8,
)


def _lark_chain(n: int) -> str:
    return "start: r0\n" + "".join(f'r{i}: "t" r{i + 1} | "u"\n' for i in range(n)) + f'r{n}: "end"\n'


LARK = st.one_of(
    st.integers(1, 40_000).map(_lark_chain),
    st.integers(1, 6000).map(lambda n: "start: " + " | ".join(f'"w{i}"' for i in range(n))),
    st.integers(1, 3000).map(lambda n: "start: " + "(" * n + '"a"' + ")" * n),
    REGEX.map(lambda r: f"start: /{r}/"),
    GARBAGE.map(lambda g: "start: " + g),
    GARBAGE,
)
CHOICE = st.one_of(
    st.integers(1, 4000).map(lambda n: [f"c{i}" for i in range(n)]),
    st.lists(GARBAGE, min_size=1, max_size=20),
)
CONSTRAINT = st.one_of(
    REGEX.map(lambda r: {"guided_regex": r}),
    GARBAGE.map(lambda r: {"guided_regex": r}),
    SCHEMA.map(lambda s: {"guided_json": s}),
    SCHEMA.map(
        lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}
    ),
    LARK.map(lambda g: {"guided_grammar": g}),
    CHOICE.map(lambda c: {"guided_choice": c}),
)


# -- the bystander ------------------------------------------------------------------------------------
class Bystander(threading.Thread):
    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.gaps, self.ends, self.stop = url, [], [], threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Count slowly."}],
            "max_tokens": 200, "ignore_eos": True, "stream": True, "temperature": 0,
        }  # fmt: skip
        async with httpx.AsyncClient(base_url=self.url, timeout=300) as c:
            while not self.stop.is_set():
                last = None
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"content":"' in line:
                            now = time.perf_counter()
                            if last is not None:
                                self.gaps.append(now - last)
                                self.ends.append(now)
                            last = now


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--args", default="", help="more `foveal serve` arguments")
    ap.add_argument("--dump", default=None, help="write the cases in flight during the largest gap here")
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "foveal.cli", "serve", "--port", str(a.port), "--log-level", "WARNING"]
    server = subprocess.Popen(cmd + a.args.split(), cwd=root)
    url = f"http://127.0.0.1:{a.port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        by = Bystander(url)
        by.start()
        while len(by.gaps) < 5:
            time.sleep(0.05)
        start_gap = len(by.gaps)
        codes: collections.Counter = collections.Counter()
        five: list[tuple[int, str]] = []
        slowest = [0.0, None]
        spans: list[tuple[float, float, str]] = []  # each case's (start, end, constraint)
        client = httpx.Client(base_url=url, timeout=120)

        @settings(max_examples=a.cases, deadline=None, database=None, derandomize=a.seed == 0,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(CONSTRAINT, st.integers(1, 8))
        def case(constraint, max_tokens):
            body = {"prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0, **constraint}
            t = time.perf_counter()
            try:
                r = client.post("/v1/completions", json=body)
                code = r.status_code
            except httpx.HTTPError as e:
                code, r = f"no answer ({type(e).__name__})", None
            took = time.perf_counter() - t
            spans.append((t, t + took, json.dumps(constraint)))
            codes[code] += 1
            if took > slowest[0]:
                slowest[:] = [took, json.dumps(constraint)]
            if r is None or r.status_code >= 500:
                five.append((code, json.dumps(constraint)[:200]))

        t0 = time.perf_counter()
        case()
        wall = time.perf_counter() - t0
        by.stop.set()
        by.join(60)
        alive = server.poll() is None and httpx.get(url + "/health", timeout=5).status_code == 200
        worst = max(range(start_gap, len(by.gaps)), key=lambda i: by.gaps[i], default=None)
        during = []  # the cases in flight during the largest gap
        if worst is not None:
            t1 = by.ends[worst]
            t0 = t1 - by.gaps[worst]
            during = [c for a_, b_, c in spans if a_ < t1 and b_ > t0][:3]
            if a.dump:  # the cases in flight during the largest gap, then the slowest case
                with open(a.dump, "w") as f:
                    f.write("\n".join(during + [slowest[1] or ""]) + "\n")
            during = [c[:300] for c in during]
        gaps = sorted(by.gaps[start_gap:])
        out = {
            "cases": sum(codes.values()),
            "wall_s": round(wall, 1),
            "codes": {str(k): v for k, v in sorted(codes.items(), key=str)},
            "server_errors": len(five),
            "first_server_errors": five[:5],
            "alive": alive,
            "bystander_tokens": len(gaps),
            "bystander_gap_max_s": round(gaps[-1], 3) if gaps else None,
            "bystander_gap_p99_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3) if gaps else None,
            "cases_during_largest_gap": during,
            "slowest_case_s": round(slowest[0], 2),
            "slowest_case": (slowest[1] or "")[:300],
        }
        print(json.dumps(out))
        sys.exit(0 if alive and not five else 1)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
