"""Schemathesis against the served `/openapi.json`: every operation, property-based requests (positive
and negative), check `not_a_server_error` at least (target: 0 5xx). Two passes on one server started
with `--api-key sk-adv`: with the key (`--max-examples` per operation), then without it
(`--no-key-examples` per operation: the 401 paths). Generation is kept short: the hooks in
`_schemathesis_hooks.py` lower max_tokens to `--max-tokens` (and add it where a body has none) and cap
n / min_tokens / prompt lists; the same hooks log every request, so the counts here are our own.

    .venv/bin/python benchmarks/adversarial/schemathesis_run.py                       # 200 per operation
    .venv/bin/python benchmarks/adversarial/schemathesis_run.py --max-examples 20 --no-key-examples 5

Time is bounded: `--max-time` (passed to schemathesis, which then repeats fuzzing until it is spent;
0 = off, the examples bound alone) and a hard `--timeout` per pass after which schemathesis is killed.
A POST route the served schema gives no request-body schema gets, by default (`--body-schemas auto`),
the JSON schema of the pydantic model the route parses (foveal.server.protocol of the tree under test)
in a patched copy of the schema, so its fields are fuzzed either way; `--body-schemas served` tests the
served schema as it is (without bodies schemathesis sends POSTs with no body: only 400s come back).

Needs schemathesis 4.x in the venv (`.venv/bin/pip install schemathesis`). Prints a table, then one
JSON object as the last line. Exit status 1 if any 5xx was seen (or a pass sent no request or the
server died), 0 otherwise; schemathesis' own exit status and summary are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import SRC, Server, emit, table, used_blocks, wait_idle  # noqa: E402

BODY_MODELS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}


def inject_body_schemas(spec: dict) -> list[str]:
    """Give the POST routes that have no request-body schema the one of the pydantic model the route
    parses (foveal.server.protocol, from the tree under test), so schemathesis can fuzz their fields.
    Returns the paths it changed."""
    sys.path.insert(0, SRC)
    import foveal.server.protocol as protocol

    comps = spec.setdefault("components", {}).setdefault("schemas", {})
    done = []
    for path, name in BODY_MODELS.items():
        op = spec.get("paths", {}).get(path, {}).get("post")
        if op is None or op.get("requestBody"):
            continue
        js = getattr(protocol, name).model_json_schema(ref_template="#/components/schemas/{model}")
        for k, v in js.pop("$defs", {}).items():
            comps.setdefault(k, v)
        comps.setdefault(name, js)
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
        }
        done.append(path)
    return done


def schemathesis_bin() -> str | None:
    cand = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return cand if os.path.exists(cand) else shutil.which("schemathesis")


def run_pass(
    name: str, srv: Server, args, exe: str, workdir: str, key: bool, examples: int, schema: str | None
) -> dict:
    log = os.path.join(workdir, f"calls-{name}.jsonl")
    location = ["--url", srv.url, schema] if schema else [f"{srv.url}/openapi.json"]
    cmd = [
        exe,
        "run",
        *location,
        "--checks",
        args.checks,
        "--max-examples",
        str(examples),
        "--seed",
        str(args.seed),
        "--workers",
        str(args.workers),
        "--request-timeout",
        str(args.request_timeout),
        "--phases",
        args.phases,
        "--mode",
        args.mode,
        "--generation-database",
        "none",
        "--report",
        "junit",
        "--report-dir",
        os.path.join(workdir, f"report-{name}"),
        "--no-color",
        "--output-truncate",
        "true",
    ]
    if args.max_time > 0:
        cmd += ["--max-time", str(int(args.max_time))]
    if key and srv.api_key:
        cmd += ["--header", f"Authorization: Bearer {srv.api_key}"]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": os.path.join(HERE, "_schemathesis_hooks.py"),
        "ADV_CALL_LOG": log,
        "ADV_MAX_TOKENS_HINT": str(args.max_tokens),
        "NO_COLOR": "1",
    }
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd,
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    killed = False
    try:
        out, _ = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        killed = True
        os.killpg(p.pid, signal.SIGTERM)
        try:
            out, _ = p.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, _ = p.communicate(timeout=15)
    calls = []
    if os.path.exists(log):
        with open(log) as f:
            calls = [json.loads(ln) for ln in f if ln.strip()]
    statuses = Counter(c["status"] for c in calls)
    per_op = Counter(f"{c['method']} {c['path']}" for c in calls)
    five = [c for c in calls if (c.get("status") or 0) >= 500]
    tail = [ln for ln in (out or "").splitlines() if ln.strip()][-12:]
    return {
        "pass": name,
        "with_key": key,
        "max_examples": examples,
        "requests": len(calls),
        "per_operation": dict(sorted(per_op.items())),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "5xx": len(five),
        "5xx_samples": five[:5],
        "network_errors": sum(1 for c in calls if c.get("network_error")),
        "schemathesis_rc": p.returncode,
        "killed_at_timeout": killed,
        "wall_s": round(time.monotonic() - t0, 1),
        "schemathesis_tail": tail,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-examples", type=int, default=200, help="per operation, pass with the key")
    ap.add_argument("--no-key-examples", type=int, default=20, help="per operation, pass without the key")
    ap.add_argument("--checks", default="not_a_server_error", help="schemathesis --checks (or 'all')")
    ap.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    ap.add_argument("--mode", default="all", choices=["positive", "negative", "all"])
    ap.add_argument(
        "--body-schemas",
        choices=["auto", "served"],
        default="auto",
        help="auto: POST routes the served schema gives no request body get their pydantic model's "
        "schema (foveal.server.protocol); served: test the served schema as it is",
    )
    ap.add_argument("--max-tokens", type=int, default=8, help="max_tokens hint put into request bodies")
    ap.add_argument("--max-time", type=float, default=0, help="schemathesis --max-time per pass (0: off)")
    ap.add_argument("--timeout", type=float, default=900, help="hard limit per pass (s)")
    ap.add_argument("--request-timeout", type=float, default=120)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `foveal serve` flag (repeat)")
    args = ap.parse_args()

    res: dict = {
        "benchmark": "adversarial_schemathesis",
        "seed": args.seed,
        "checks": args.checks,
        "max_examples": args.max_examples,
        "max_tokens_hint": args.max_tokens,
    }
    exe = schemathesis_bin()
    if exe is None:
        res["error"] = "schemathesis not found: .venv/bin/pip install schemathesis"
        print(res["error"])
        emit(res)
        return 2
    res["schemathesis_version"] = subprocess.run(
        [exe, "--version"], capture_output=True, text=True, timeout=60
    ).stdout.strip()
    workdir = tempfile.mkdtemp(prefix="foveal-adv-st-")
    res["workdir"] = workdir
    srv = Server(["--request-timeout", "120", *args.server_arg])
    passes: list[dict] = []
    try:
        srv.start()
        spec = httpx.get(srv.url + "/openapi.json", timeout=10).json()
        ops = [
            (m.upper(), path, bool(op.get("requestBody")))
            for path, item in spec.get("paths", {}).items()
            for m, op in item.items()
            if isinstance(op, dict)
        ]
        res["operations"] = len(ops)
        res["operation_names"] = [f"{m} {p}" for m, p, _ in ops]
        res["operations_with_body_schema"] = sum(1 for *_, b in ops if b)
        schema = None
        if args.body_schemas == "auto":
            res["injected_body_schemas"] = inject_body_schemas(spec)
            if res["injected_body_schemas"]:
                schema = os.path.join(workdir, "openapi-with-bodies.json")
                with open(schema, "w") as f:
                    json.dump(spec, f)
        passes.append(run_pass("with_key", srv, args, exe, workdir, True, args.max_examples, schema))
        if args.no_key_examples > 0 and srv.alive():
            passes.append(run_pass("no_key", srv, args, exe, workdir, False, args.no_key_examples, schema))
        res["server_alive"] = srv.alive()
        if srv.alive():
            idle = wait_idle(srv, 60)
            res["leaked_blocks"], _ = used_blocks(srv.cache_stats())
            res["in_flight_after"] = idle.get("in_flight")
            res["health_after"] = httpx.get(srv.url + "/health", timeout=10).status_code
    except Exception as e:  # the run itself broke: still one JSON line
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        srv.stop()
    res["passes"] = passes
    res["requests"] = sum(p["requests"] for p in passes)
    res["5xx"] = sum(p["5xx"] for p in passes)
    res["server_log"] = srv.log_findings()
    broke = (
        "error" in res or not res.get("server_alive") or any(p["requests"] == 0 for p in passes) or not passes
    )
    ok = res["5xx"] == 0 and not broke
    res["pass"] = ok
    print(
        f"\nschemathesis {res.get('schemathesis_version', '?')}: {res.get('operations')} operations "
        f"({res.get('operations_with_body_schema')} with a served request-body schema; injected for "
        f"{res.get('injected_body_schemas') or 'none'}), checks {args.checks}"
    )
    rows = []
    documented = set(res.get("operation_names", []))
    for p in passes:
        other = 0
        for op, n in p["per_operation"].items():
            if op in documented:
                rows.append((p["pass"], op, n))
            else:
                other += n
        rows.append((p["pass"], "(methods the schema does not list)", other))
    table(rows, ("pass", "operation", "requests"))
    print()
    table(
        [
            (
                p["pass"],
                p["requests"],
                p["statuses"],
                p["5xx"],
                p["network_errors"],
                p["schemathesis_rc"],
                p["wall_s"],
                "yes" if p["killed_at_timeout"] else "no",
            )
            for p in passes
        ],
        ("pass", "requests", "statuses", "5xx", "net errors", "st rc", "wall s", "killed"),
    )
    for p in passes:
        for s in p["5xx_samples"]:
            print(f"5xx: {s}")
    print(
        f"\nleaked KV blocks {res.get('leaked_blocks')}, server log tracebacks "
        f"{res['server_log']['tracebacks']}, verdict {'PASS' if ok else 'FAIL'}"
        + (f" ({res['error']})" if "error" in res else "")
    )
    emit(res)
    return 0 if ok else (2 if broke and res["5xx"] == 0 else 1)


if __name__ == "__main__":
    sys.exit(main())
