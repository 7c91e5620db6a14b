"""Time to ready and to the first token of `foveal serve`, cold and warm, with a per-phase breakdown.

Each run starts a fresh `foveal serve` process (default model and flags unless --args), polls
/health until it says ready, then sends two streamed /v1/completions requests one after the other
(different prompts: no prefix-cache hit) and times their first tokens. The server's INFO log lines are
timestamped as they arrive (seconds since the process was spawned), and the phases the log names
("... in X s") are listed per run.

  cold: FOVEAL_CACHE_DIR is a fresh empty folder (the GGUF tokenizer is converted and the native
        kernels are compiled in that run, as on a machine that never ran Foveal)
  warm: FOVEAL_CACHE_DIR is the folder a first, unmeasured run filled

Usage: .venv/bin/python benchmarks/startup.py [--runs 3] [--modes cold,warm] [--args "--dtype bfloat16"]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

PHASE = re.compile(r"(?P<what>[^\s].*?) in (?P<s>[0-9.]+) s\b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=0.5) as r:
            return r.status == 200 and b"ready" in r.read()
    except Exception:
        return False


def first_token(port: int, prompt: str, max_tokens: int = 8) -> tuple[float, float]:
    """(seconds to the first streamed token, seconds to the end) of one streamed completion."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


def one_run(cache_dir: str, extra: list[str]) -> dict:
    port = free_port()
    env = dict(os.environ, FOVEAL_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "foveal.cli", "serve", "--port", str(port), "--log-level", "INFO", *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []

    def pump():
        for line in proc.stderr:
            lines.append((time.perf_counter() - t0, line.rstrip()))

    threading.Thread(target=pump, daemon=True).start()
    try:
        while not ready(port):
            if proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "\n".join(x for _, x in lines[-20:]))
            if time.perf_counter() - t0 > 300:
                raise RuntimeError("not ready after 300 s")
            time.sleep(0.02)
        t_ready = time.perf_counter() - t0
        first, first_total = first_token(port, "The first request after start-up says")
        second, second_total = first_token(port, "A later request, on a warm server, says")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    phases = []
    for at, line in lines:
        m = PHASE.search(line)
        if m and "foveal" in line:
            phases.append({"at": round(at, 2), "seconds": float(m["s"]), "what": m["what"][-120:]})
    return {
        "ready_s": round(t_ready, 3),
        "first_ttft_s": round(first, 3),
        "first_total_s": round(first_total, 3),
        "second_ttft_s": round(second, 3),
        "second_total_s": round(second_total, 3),
        "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="cold,warm")
    ap.add_argument("--args", default="", help="extra `foveal serve` flags")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    extra = shlex.split(a.args)
    out = {"command": " ".join(sys.argv), "serve_args": extra, "modes": {}}
    warm_dir = tempfile.mkdtemp(prefix="foveal-warm-")
    if "warm" in a.modes.split(","):
        one_run(warm_dir, extra)  # fills the cache; not measured
    for mode in a.modes.split(","):
        runs = []
        for _ in range(a.runs):
            cache = tempfile.mkdtemp(prefix="foveal-cold-") if mode == "cold" else warm_dir
            r = one_run(cache, extra)
            runs.append(r)
            print(
                f"{mode}: ready {r['ready_s']:.2f} s, first request TTFT {r['first_ttft_s']:.3f} s "
                f"(8 tokens {r['first_total_s']:.3f} s), a later one {r['second_ttft_s']:.3f} s "
                f"({r['second_total_s']:.3f} s)",
                flush=True,
            )
            for p in r["phases"]:
                print(f"    at {p['at']:6.2f} s  {p['seconds']:6.2f} s  {p['what']}")
        med = {k: statistics.median(r[k] for r in runs) for k in ("ready_s", "first_ttft_s", "second_ttft_s")}
        out["modes"][mode] = {"runs": runs, "median": med}
        print(
            f"{mode} median: ready {med['ready_s']:.2f} s, TTFT first {med['first_ttft_s']:.3f} s, "
            f"later {med['second_ttft_s']:.3f} s"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
