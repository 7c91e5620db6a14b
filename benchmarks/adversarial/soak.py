"""Soak: `--streams` clients kept busy for `--duration` seconds, each sending streamed requests back to
back (random prompts, chat or completion, random max_tokens), while the server's RSS (its process plus
children) is sampled every `--interval` s. Prints the RSS curve (time, RSS MiB, requests completed) and
a summary: RSS at the end of warm-up, at the end and its max after warm-up, the slope in MiB/min over
the second half (least squares), completed requests, errors, 5xx, 429s. A 429 is honoured: the client
sleeps its Retry-After (at most 10 s) and counts it apart from errors.

    .venv/bin/python benchmarks/adversarial/soak.py --streams 256 --duration 600
    .venv/bin/python benchmarks/adversarial/soak.py --streams 32 --duration 60      # a quick check

Starts its own `foveal serve` (127.0.0.1, free port, --api-key sk-adv); `--server-arg=--flag` passes
more flags (e.g. `--server-arg=--max-queued-requests=64` to see 429s). After the duration no new request
starts; requests in flight get `--grace` s to finish, then are cancelled; then the server must go idle
with 0 KV blocks held. Prints a table, then one JSON object as the last line. Exit status 1 when a
target is missed (5xx, leaked blocks, RSS slope over --max-slope MiB/min). The RSS slope is judged
from the first eviction on (every KV block has then been handed out once) and after warm-up, with at
least 3 samples; a run too short for that reports the RSS verdict as inconclusive and is not failed on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import WORDS, Server, emit, rss_bytes, table, used_blocks, wait_idle  # noqa: E402

MiB = 2**20


def slope_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mr = sum(r for _, r in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    return 60.0 * sum((t - mt) * (r - mr) for t, r in points) / var


class Tally:
    def __init__(self) -> None:
        self.completed = 0
        self.tokens = 0
        self.errors = 0
        self.five = 0
        self.r429 = 0
        self.statuses: Counter = Counter()
        self.first_error: str | None = None
        self.first_5xx: str | None = None

    def error(self, msg: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or msg[:300]


async def one(c: httpx.AsyncClient, rng: random.Random, args, tally: Tally) -> float:
    """One streamed request; returns how long to sleep before the next (a 429's Retry-After)."""
    chat = rng.random() < 0.5
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, args.prompt_words)))
    body: dict = {
        "max_tokens": rng.randint(args.min_tokens, args.max_tokens),
        "stream": True,
        "temperature": rng.choice([0.0, 0.7]),
        "stream_options": {"include_usage": True},
    }
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with c.stream("POST", path, json=body) as r:
        tally.statuses[r.status_code] += 1
        if r.status_code == 429:
            tally.r429 += 1
            await r.aread()
            try:
                return min(10.0, float(r.headers.get("retry-after", "1")))
            except ValueError:
                return 1.0
        if r.status_code != 200:
            text = (await r.aread())[:300].decode("utf-8", "replace")
            if r.status_code >= 500:
                tally.five += 1
                tally.first_5xx = tally.first_5xx or f"{r.status_code}: {text}"
            tally.error(f"HTTP {r.status_code}: {text}")
            return 0.0
        done, usage, finish = False, None, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                tally.error(f"error event: {chunk['error']}")
                return 0.0
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices", []):
                finish = ch.get("finish_reason") or finish
        if not done or finish is None:
            tally.error(f"stream ended without [DONE] or finish_reason (done={done}, finish={finish})")
            return 0.0
        tally.completed += 1
        tally.tokens += (usage or {}).get("completion_tokens", 0)
    return 0.0


async def drive(srv: Server, args, tally: Tally, samples: list[dict]) -> dict:
    t0 = time.monotonic()
    stop_at = t0 + args.duration
    limits = httpx.Limits(max_connections=args.streams + 8, max_keepalive_connections=args.streams)

    async with httpx.AsyncClient(
        base_url=srv.url, headers=srv.headers, limits=limits, timeout=httpx.Timeout(args.timeout)
    ) as c:

        async def sampler():
            nxt = t0
            while True:
                try:
                    rss = rss_bytes(srv.pid) / MiB
                except Exception as e:  # the server is gone: record it and stop sampling
                    samples.append({"t_s": round(time.monotonic() - t0, 1), "error": f"{type(e).__name__}"})
                    return
                try:  # the KV pool's state: blocks held, cached, evictions (> 0: every block was used once)
                    pc = (await c.get("/v1/cache/stats", timeout=10)).json().get("prefix_cache", {})
                except (httpx.HTTPError, ValueError):
                    pc = {}
                samples.append(
                    {
                        "t_s": round(time.monotonic() - t0, 1),
                        "rss_mib": round(rss, 1),
                        "completed": tally.completed,
                        "errors": tally.errors,
                        "r429": tally.r429,
                        "used_blocks": pc.get("used_blocks"),
                        "cached_blocks": pc.get("cached_blocks"),
                        "evictions": pc.get("evictions"),
                    }
                )
                if time.monotonic() >= stop_at:
                    return
                nxt += args.interval
                await asyncio.sleep(max(0.0, min(nxt, stop_at) - time.monotonic()))

        async def stream_worker(k: int):
            rng = random.Random(args.seed * 100003 + k)
            n = 0
            while time.monotonic() < stop_at and n < args.max_requests_per_stream:
                n += 1
                try:
                    wait = await one(c, rng, args, tally)
                except (httpx.HTTPError, json.JSONDecodeError) as e:
                    tally.error(f"{type(e).__name__}: {e}")
                    wait = 0.5
                if wait:
                    await asyncio.sleep(min(wait, max(0.0, stop_at - time.monotonic())))

        samp = asyncio.create_task(sampler())
        workers = [asyncio.create_task(stream_worker(k)) for k in range(args.streams)]
        await samp
        _, pending = await asyncio.wait(workers, timeout=args.grace)  # in-flight requests may finish
        for w in pending:
            w.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return {"cancelled_at_end": len(pending), "wall_s": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--interval", type=float, default=10.0, help="RSS sample period (s)")
    ap.add_argument("--warmup", type=float, help="s left out of start/max (default 1/4, <= 60)")
    ap.add_argument("--min-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=100, help="most words in a prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request (s)")
    ap.add_argument("--grace", type=float, default=60.0, help="s for in-flight requests after the duration")
    ap.add_argument("--max-requests-per-stream", type=int, default=100000)
    ap.add_argument("--max-slope", type=float, default=5.0, help="target: RSS MiB/min in the second half")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `foveal serve` flag (repeat)")
    args = ap.parse_args()
    warmup = args.warmup if args.warmup is not None else min(60.0, args.duration / 4)

    srv = Server(args.server_arg)
    tally = Tally()
    samples: list[dict] = []
    res: dict = {
        "benchmark": "adversarial_soak",
        "streams": args.streams,
        "duration_s": args.duration,
        "warmup_s": warmup,
        "seed": args.seed,
    }
    try:
        srv.start()
        res["server_startup_s"] = round(srv.startup_s or 0, 1)
        res["rss_idle_mib"] = round(rss_bytes(srv.pid) / MiB, 1)
        res.update(asyncio.run(drive(srv, args, tally, samples)))
        idle = wait_idle(srv, 60.0)
        res["rss_after_idle_mib"] = round(rss_bytes(srv.pid) / MiB, 1) if srv.alive() else None
        res["leaked_blocks"], res["leaked_blocks_from"] = used_blocks(srv.cache_stats())
        res["idle"] = idle
        res["server_alive"] = srv.alive()
    except Exception as e:  # the run itself broke: still one JSON line
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
    finally:
        srv.stop()
    good = [s for s in samples if "rss_mib" in s]
    after = [s for s in good if s["t_s"] >= warmup] or good[-1:]
    half = [(s["t_s"], s["rss_mib"]) for s in good if s["t_s"] >= args.duration / 2]
    slope = slope_per_min(half)
    # With prefix caching the pool hands out never-used blocks first; the first eviction says every
    # block has been used once, so RSS growth from then on is not first use of the pool's pages.
    cycled = next((s["t_s"] for s in good if (s.get("evictions") or 0) > 0), None)
    post = [(s["t_s"], s["rss_mib"]) for s in good if cycled is not None and s["t_s"] >= max(cycled, warmup)]
    slope_post = slope_per_min(post) if len(post) >= 3 else None
    res.update(
        {
            "completed": tally.completed,
            "completion_tokens": tally.tokens,
            "errors": tally.errors,
            "first_error": tally.first_error,
            "5xx": tally.five,
            "first_5xx": tally.first_5xx,
            "429": tally.r429,
            "statuses": {str(k): v for k, v in tally.statuses.items()},
            "rss_start_mib": after[0]["rss_mib"] if after else None,
            "rss_end_mib": good[-1]["rss_mib"] if good else None,
            "rss_max_mib": max(s["rss_mib"] for s in after) if after else None,
            "rss_slope_mib_per_min_2nd_half": round(slope, 2) if slope is not None else None,
            "pool_cycled_at_s": cycled,
            "rss_slope_mib_per_min_after_pool_cycled": round(slope_post, 2)
            if slope_post is not None
            else None,
            "rss_curve": [
                (
                    s["t_s"],
                    s["rss_mib"],
                    s["completed"],
                    s.get("used_blocks"),
                    s.get("cached_blocks"),
                    s.get("evictions"),
                )
                for s in good
            ],
            "server_log": srv.log_findings(),
        }
    )
    # the RSS target: the slope once the KV pool has been used through (else the 2nd half's)
    # Judged only from the first eviction on (every KV block handed out once, after warm-up) with >= 3
    # samples; a run too short for that is "inconclusive" for RSS and not failed on it.
    gate = slope_post
    res["rss_verdict"] = (
        "inconclusive (KV pool not used through yet: run longer)"
        if gate is None
        else ("ok" if gate <= args.max_slope else f"over {args.max_slope} MiB/min")
    )
    ok = (
        res["5xx"] == 0
        and res.get("leaked_blocks") == 0
        and "error" not in res
        and (gate is None or gate <= args.max_slope)
        and res.get("server_alive")
    )
    res["pass"] = bool(ok)
    print(f"\nsoak: {args.streams} streams x {args.duration:.0f} s (warm-up {warmup:.0f} s)")
    table(
        [
            (
                s["t_s"],
                s["rss_mib"],
                s["completed"],
                s["errors"],
                s["r429"],
                s.get("used_blocks"),
                s.get("cached_blocks"),
                s.get("evictions"),
            )
            for s in good
        ],
        ("t (s)", "RSS MiB", "completed", "errors", "429s", "KV used", "KV cached", "evictions"),
    )
    print()
    table(
        [
            ("RSS idle before load (MiB)", res.get("rss_idle_mib")),
            (
                "RSS after warm-up / end / max",
                f"{res['rss_start_mib']} / {res['rss_end_mib']} / {res['rss_max_mib']}",
            ),
            ("RSS slope, 2nd half (MiB/min)", res["rss_slope_mib_per_min_2nd_half"]),
            ("KV pool fully used once at (s)", cycled),
            ("RSS slope after that (MiB/min)", res["rss_slope_mib_per_min_after_pool_cycled"]),
            ("RSS once idle (MiB)", res.get("rss_after_idle_mib")),
            ("RSS verdict", res["rss_verdict"]),
            ("completed requests", f"{tally.completed} ({tally.tokens} tokens)"),
            ("errors / 5xx / 429", f"{tally.errors} / {tally.five} / {tally.r429}"),
            ("cancelled at the end", res.get("cancelled_at_end")),
            ("leaked KV blocks", res.get("leaked_blocks")),
            ("server log tracebacks", res["server_log"]["tracebacks"]),
            ("verdict", "PASS" if ok else "FAIL"),
        ],
        ("summary", "value"),
    )
    emit(res)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
