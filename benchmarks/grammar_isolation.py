"""What fencing grammar compilation costs, and what compiled grammars hold (issue 34), on the embedded
model's tokenizer:

1. compile time of a few grammars on the backend's compile thread (256 MiB stack, the default) against
   the same compile checked first in a worker process (spawned once, holding its own tokenizer), which
   is what process isolation would cost: the compiled grammar cannot leave the worker, so the grammar
   is compiled there (to see it survive) and then here. Medians of `--repeat` distinct grammars each.
2. resident memory per compiled grammar, held in a list: distinct choice lists of ~30 and ~300 KB and
   maskbench-sized JSON schemas; the bytes per byte of grammar definition are what
   llguidance_backend.grammar_nbytes estimates with.
3. the stack a Lark chain of 3,000 and of 10,000 rules (the limit, start included) needs: each
   compiled in a fresh process on a thread of 8, 16, 32 and 64 MiB; survived or died (a segfault:
   the stack overflowed).

    python benchmarks/grammar_isolation.py [--repeat 5] [--hold 20]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tokenizer():
    from transformers import AutoTokenizer

    from foveal.loader.default_model import default_model_path

    d, f = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(d, gguf_file=f)


def worker(conn) -> None:
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend.from_tokenizer(tokenizer())
    conn.send("ready")
    while True:
        spec = conn.recv()
        if spec is None:
            return
        try:
            backend.compile(spec)
            conn.send(None)
        except ValueError as e:
            conn.send(str(e))


def specs(kind: str, i: int, size: int = 0):
    from foveal.structured.constraint import OutputConstraint

    if kind == "schema":  # an object of a dozen typed fields: a typical maskbench-sized schema
        props = {f"f{i}_{j}": {"type": ["string", "integer", "boolean"][j % 3]} for j in range(12)}
        return OutputConstraint.json_schema({"type": "object", "properties": props, "required": list(props)})
    if kind == "choice":  # up to 900 distinct strings (the limit is 1,000) adding up to ~size bytes
        n = min(900, max(1, size // 160))
        return OutputConstraint.choice([f"{i}-{j}-" + "x" * (size // n - 10) for j in range(n)])
    if kind == "chain":  # a Lark chain of 2,000 rules
        rules = "".join(f'r{j}: "t{i}" r{j + 1} | "u"\n' for j in range(2000))
        return OutputConstraint.lark("start: r0\n" + rules + 'r2000: "end"\n')
    raise ValueError(kind)


STACK_PROBE = """
import sys, threading
sys.path.insert(0, {root!r})
import foveal.structured.llguidance_backend as lb
from benchmarks.grammar_isolation import tokenizer
from foveal.structured.constraint import OutputConstraint
lb.COMPILE_STACK_BYTES = {mb} * 2**20
n = {rules}
rules = "".join(f'r{{j}}: "t" r{{j + 1}} | "u"\\n' for j in range(n - 1))
grammar = "start: r0\\n" + rules + f'r{{n - 1}}: "end"\\n'
lb.LLGuidanceBackend.from_tokenizer(tokenizer()).compile(OutputConstraint.lark(grammar))
"""


def stack_probe() -> dict:
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for rules in (3_000, 9_999):  # with start: 10,000 rules, the limit
        for mb in (8, 16, 32, 64):
            code = STACK_PROBE.format(root=root, mb=mb, rules=rules)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600)
            what = "compiled" if r.returncode == 0 else f"died (exit {r.returncode})"
            if r.returncode > 0:  # an exception, not a crash: say which
                what += ": " + r.stderr.decode(errors="replace").strip().splitlines()[-1][:120]
            out[f"{rules} rules, {mb} MiB"] = what
            print(f"{rules:6d} rules on a {mb:2d} MiB stack: {what}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--hold", type=int, default=20)
    a = ap.parse_args()
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    backend = LLGuidanceBackend.from_tokenizer(tokenizer())
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    t = time.perf_counter()
    proc = ctx.Process(target=worker, args=(there,), daemon=True)
    proc.start()
    assert here.recv() == "ready"
    spawn_s = time.perf_counter() - t
    out: dict = {"worker_start_s": round(spawn_s, 2), "compile_ms": {}, "bytes_per_grammar": {}}
    print(f"worker process ready in {spawn_s:.2f} s (its own tokenizer and llguidance tokenizer)")
    seq = 0
    for kind, size in (("schema", 0), ("choice", 30_000), ("chain", 0)):
        thread_ms, process_ms = [], []
        for _ in range(a.repeat):
            seq += 1
            spec = specs(kind, seq, size)
            t = time.perf_counter()
            backend.compile(spec)
            thread_ms.append((time.perf_counter() - t) * 1e3)
            seq += 1
            spec = specs(kind, seq, size)
            t = time.perf_counter()
            here.send(spec)
            assert here.recv() is None
            backend.compile(spec)
            process_ms.append((time.perf_counter() - t) * 1e3)
        th, pr = statistics.median(thread_ms), statistics.median(process_ms)
        out["compile_ms"][kind] = {"thread": round(th, 2), "process_then_thread": round(pr, 2)}
        print(f"{kind:>7}: compile thread {th:7.2f} ms; worker process, then here {pr:7.2f} ms")
    here.send(None)
    proc.join(5)
    for kind, size in (("schema", 0), ("choice", 30_000), ("choice", 300_000)):
        held = []
        text_bytes = 0
        before = rss()
        for _ in range(a.hold):
            seq += 1
            spec = specs(kind, seq, size)
            g = backend.compile(spec)
            text_bytes += len(backend.grammar_text(spec))
            held.append(g)
        grew = rss() - before
        per = grew / a.hold
        label = f"{kind} {size // 1000} KB" if size else kind
        out["bytes_per_grammar"][label] = {
            "rss_per_grammar": int(per),
            "definition_bytes": text_bytes // a.hold,
            "estimate": sum(g.nbytes for g in held) // a.hold,
        }
        size, est = text_bytes / a.hold, sum(g.nbytes for g in held) / a.hold
        print(
            f"{label:>12}: {per / 2**20:7.2f} MiB resident per grammar, definition {size / 1e3:.0f} KB "
            f"({per / max(1.0, size):.0f} B/B); estimate {est / 2**20:.2f} MiB"
        )
        del held
    out["stack"] = stack_probe()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
