"""Clients that walk away: N streamed chat/completion requests (random prompts, random max_tokens), each
client dropping its connection at a random point, `--concurrency` at a time; then, once the server is
idle, the KV blocks still held (target 0) and any 5xx (target 0).

Where a client leaves (seeded, per request):
  before_headers  the request is sent and the connection closed within 0-300 ms, usually before the
                  response headers (admission, prompt rendering or prefill still under way)
  after_headers   headers read, connection closed before the first body byte
  after_k         k SSE events read (k in 1..max_tokens+2), then closed
  nonstream       a non-streamed request, connection closed after 0.05-2 s (the server's watcher path)
  complete        read to [DONE] (control: must end with a finish_reason, no error event)
Half the prompts start with one of 4 shared prefixes, so aborted requests also drop references on
prefix-cache blocks that others hold.

    .venv/bin/python benchmarks/adversarial/disconnects.py --num-requests 1000 --concurrency 16

Starts its own `foveal serve` (127.0.0.1, free port, --api-key sk-adv); `--server-arg=--flag` passes
more flags. Prints a table, then one JSON object as the last line. Exit status 1 when a target is missed
(leaked blocks, a 5xx, a request still in flight when idle, a control request that did not finish).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import time
from collections import Counter

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import WORDS, Server, emit, table, used_blocks, wait_idle  # noqa: E402

MODES = ("before_headers", "after_headers", "after_k", "nonstream", "complete")
WEIGHTS = (0.2, 0.2, 0.45, 0.05, 0.10)
PREFIXES = [" ".join(random.Random(100 + i).choice(WORDS) for _ in range(48)) for i in range(4)]


def plan(rng: random.Random, i: int, args) -> dict:
    mode = rng.choices(MODES, WEIGHTS)[0]
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
    text = (rng.choice(PREFIXES) + " " + words) if rng.random() < 0.5 else words
    chat = rng.random() < 0.5
    body: dict = {"max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]), "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if mode != "nonstream":
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    return {
        "i": i,
        "mode": mode,
        "path": "/v1/chat/completions" if chat else "/v1/completions",
        "body": body,
        "k": rng.randint(1, max_tokens + 2),
        "cut_s": rng.uniform(0.0, 0.3) if mode == "before_headers" else rng.uniform(0.05, 2.0),
    }


async def one(c: httpx.AsyncClient, p: dict, timeout: float) -> dict:
    """Run one planned request; returns what happened (status, where the client really left)."""
    out = {"mode": p["mode"], "status": None, "left_at": None, "events": 0, "error_event": None}
    req = c.build_request("POST", p["path"], json=p["body"])
    if p["mode"] == "nonstream":
        try:
            r = await asyncio.wait_for(c.send(req), p["cut_s"])
            out["status"], out["left_at"] = r.status_code, "after_response"
            if r.status_code >= 500:
                out["body"] = r.text[:300]
        except TimeoutError:
            out["left_at"] = "during_request"
        return out
    try:
        if p["mode"] == "before_headers":
            r = await asyncio.wait_for(c.send(req, stream=True), p["cut_s"])
        else:
            r = await asyncio.wait_for(c.send(req, stream=True), timeout)
    except TimeoutError:
        out["left_at"] = "before_headers" if p["mode"] == "before_headers" else "timeout_before_headers"
        return out
    try:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["body"] = (await asyncio.wait_for(r.aread(), timeout))[:300].decode("utf-8", "replace")
            out["left_at"] = "error_status"
            return out
        if p["mode"] in ("before_headers", "after_headers"):
            out["left_at"] = "after_headers"
            return out
        limit = p["k"] if p["mode"] == "after_k" else 10**9
        done = False
        finish = None

        async def read():
            nonlocal done, finish
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    return
                out["events"] += 1
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    out["error_event"] = str(chunk["error"])[:300]
                for ch in chunk.get("choices", []):
                    finish = ch.get("finish_reason") or finish
                if out["events"] >= limit:
                    return

        try:
            await asyncio.wait_for(read(), timeout)
        except TimeoutError:
            out["left_at"] = "timeout_mid_stream"
            return out
        out["left_at"] = "done" if done else f"after_{out['events']}_events"
        out["finish_reason"] = finish
        return out
    finally:
        await r.aclose()  # not fully read: httpx closes the connection (the client is gone)


async def drive(srv: Server, args) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    plans = [plan(rng, i, args) for i in range(args.num_requests)]
    results: list[dict] = []
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency)
    t0 = time.monotonic()
    stop_at = t0 + args.deadline
    async with httpx.AsyncClient(
        base_url=srv.url, headers=srv.headers, limits=limits, timeout=httpx.Timeout(args.timeout)
    ) as c:

        async def guarded(p: dict) -> None:
            async with sem:
                if time.monotonic() > stop_at:
                    results.append({"mode": p["mode"], "status": None, "left_at": "not_sent_deadline"})
                    return
                try:
                    results.append(await one(c, p, args.timeout))
                except httpx.HTTPError as e:
                    results.append(
                        {
                            "mode": p["mode"],
                            "status": None,
                            "left_at": "client_error",
                            "client_error": f"{type(e).__name__}: {e}"[:200],
                        }
                    )

        await asyncio.gather(*(guarded(p) for p in plans))
    return results, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", "-n", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--min-tokens", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0, help="per request (s)")
    ap.add_argument("--deadline", type=float, default=1800.0, help="no new request after this many s")
    ap.add_argument("--idle-timeout", type=float, default=60.0, help="wait this long for the server to idle")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `foveal serve` flag (repeat)")
    args = ap.parse_args()

    srv = Server(args.server_arg)
    res: dict = {
        "benchmark": "adversarial_disconnects",
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "seed": args.seed,
    }
    try:
        srv.start()
        res["server_startup_s"] = round(srv.startup_s or 0, 1)
        before = srv.cache_stats()
        results, wall = asyncio.run(drive(srv, args))
        idle = wait_idle(srv, args.idle_timeout)
        after = srv.cache_stats()
        health = httpx.get(srv.url + "/health", timeout=10).status_code
        probe = httpx.post(
            srv.url + "/v1/completions",
            headers=srv.headers,
            timeout=60,
            json={"prompt": "Hello", "max_tokens": 4, "temperature": 0},
        )
        leaked, how = used_blocks(after)
        by_mode = Counter(r["mode"] for r in results)
        left_at = Counter(re.sub(r"after_\d+_events", "after_k_events", str(r["left_at"])) for r in results)
        statuses = Counter(r["status"] for r in results)
        five = [r for r in results if (r.get("status") or 0) >= 500]
        err_events = [r for r in results if r.get("error_event")]
        controls = [r for r in results if r["mode"] == "complete"]
        bad_controls = [
            r
            for r in controls
            if r["left_at"] != "done" or not r.get("finish_reason") or r.get("error_event")
        ]
        client_errors = [r for r in results if r["left_at"] == "client_error"]
        res.update(
            {
                "wall_s": round(wall, 1),
                "by_mode": dict(by_mode),
                "left_at": dict(left_at),
                "statuses": {str(k): v for k, v in statuses.items()},
                "5xx": len(five),
                "first_5xx": five[0].get("body") if five else None,
                "error_events": len(err_events),
                "first_error_event": err_events[0]["error_event"] if err_events else None,
                "client_errors": len(client_errors),
                "first_client_error": client_errors[0].get("client_error") if client_errors else None,
                "controls": len(controls),
                "controls_not_finished": len(bad_controls),
                "leaked_blocks": leaked,
                "leaked_blocks_from": how,
                "idle": idle,
                "cache_before": before.get("prefix_cache"),
                "cache_after": after.get("prefix_cache"),
                "health_after": health,
                "probe_after_status": probe.status_code,
                "server_alive": srv.alive(),
            }
        )
    except Exception as e:  # the run itself broke (server did not start, died): still one JSON line
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        srv.stop()
    res["server_log"] = srv.log_findings()
    ok = (
        res.get("5xx") == 0
        and res.get("leaked_blocks") == 0
        and res.get("controls_not_finished") == 0
        and (res.get("idle") or {}).get("in_flight") == 0
        and res.get("probe_after_status") == 200
    )
    res["pass"] = bool(ok)
    print(f"\n{res['num_requests']} requests, concurrency {res['concurrency']}, wall {res.get('wall_s')} s")
    table([(k, v) for k, v in sorted(res.get("by_mode", {}).items())], ("planned mode", "requests"))
    print()
    table([(k, v) for k, v in sorted(res.get("left_at", {}).items())], ("client left", "requests"))
    print()
    table(
        [
            ("HTTP statuses", res.get("statuses")),
            ("5xx", res.get("5xx")),
            ("in-stream error events", res.get("error_events")),
            ("client-side errors", res.get("client_errors")),
            ("controls not finished", f"{res.get('controls_not_finished')} of {res.get('controls')}"),
            ("in flight when idle", (res.get("idle") or {}).get("in_flight")),
            ("leaked KV blocks", f"{res.get('leaked_blocks')} ({res.get('leaked_blocks_from')})"),
            ("server log tracebacks", res["server_log"]["tracebacks"]),
            ("probe after run", res.get("probe_after_status")),
            ("verdict", "PASS" if ok else "FAIL"),
        ],
        ("check", "value"),
    )
    emit(res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
