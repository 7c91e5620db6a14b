"""Load generator for any OpenAI-compatible server (Foveal, vLLM, SGLang, llama.cpp's llama-server).

Sends `--num-requests` streaming /v1/completions requests with `--concurrency` in flight, each a seeded
random prompt of about `--input-len` tokens (random words; the server's tokenizer decides the exact
count, reported from usage) asking for `--output-len` tokens (ignore_eos where the server supports it).
Reports output throughput, time to first token and inter-token latency percentiles.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --concurrency 8 --num-requests 32

One Python process parses a few thousand SSE events per second (httpx + json, ~0.3 ms per event on the
dev CPU), so a fast server would measure the client: `--workers` splits the requests and the
concurrency over that many processes that start together (default: one per 32 streams, at most half
the cores). Each worker's CPU time is reported; a worker busy > 85% of the wall time means the client,
not the server, set the pace (the output says so).

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import statistics
import time

import httpx

WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue"
).split()


def make_prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))
    return xs[k]


async def one(client: httpx.AsyncClient, args, prompt: str, out: list[dict]) -> None:
    body = {
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True
    sent, t0 = time.time(), time.perf_counter()
    stamps: list[float] = []
    usage = None
    async with client.stream("POST", "/completions", json=body) as r:
        if r.status_code != 200:
            out.append({"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"})
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):  # an error event ends the stream: the request failed
                out.append({"error": str(chunk["error"].get("message", chunk["error"]))[:200]})
                return
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    end = time.perf_counter()
    out.append(
        {
            "sent": sent,
            "ttft": (stamps[0] - t0) if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            "latency": end - t0,
            "completion_tokens": usage["completion_tokens"] if usage else len(stamps),
            "prompt_tokens": usage["prompt_tokens"] if usage else 0,
        }
    )


async def _client(args, prompts: list[str], concurrency: int, start_at: float) -> dict:
    """One worker: its share of the prompts at its share of the concurrency, from `start_at` (epoch s)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    results: list[dict] = []
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, timeout=args.timeout, limits=limits
    ) as c:

        async def guarded(p: str) -> None:
            async with sem:
                try:
                    await one(c, args, p, results)
                except httpx.HTTPError as e:  # a dropped connection fails this request, not the run
                    results.append({"error": f"{type(e).__name__}: {e}"[:200]})

        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0, cpu0 = time.time(), time.process_time()
        await asyncio.gather(*(guarded(p) for p in prompts))
        t1 = time.time()
    return {"results": results, "start": t0, "end": t1, "cpu_s": time.process_time() - cpu0}


def _worker(args, prompts: list[str], concurrency: int, start_at: float) -> dict:
    return asyncio.run(_client(args, prompts, concurrency, start_at))


def run(args) -> dict:
    rng = random.Random(args.seed)
    prompts = [make_prompt(rng, args.input_len) for _ in range(args.num_requests)]
    if not args.model:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        args.model = httpx.get(f"{args.base_url}/models", headers=headers).json()["data"][0]["id"]
    workers = args.workers or max(1, min(math.ceil(args.concurrency / 32), (os.cpu_count() or 2) // 2))
    workers = min(workers, args.concurrency, args.num_requests)
    shares = [prompts[i::workers] for i in range(workers)]
    conc = [args.concurrency // workers + (i < args.concurrency % workers) for i in range(workers)]
    if workers == 1:
        parts = [_worker(args, prompts, args.concurrency, time.time())]
    else:
        start_at = time.time() + 2.0  # every worker connected and waiting
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as ex:
            futs = [ex.submit(_worker, args, shares[i], conc[i], start_at) for i in range(workers)]
            parts = [f.result() for f in futs]
    results = [r for p in parts for r in p["results"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    busy = max(p["cpu_s"] / max(p["end"] - p["start"], 1e-9) for p in parts)
    ok = [r for r in results if "error" not in r]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    if args.dump:
        first = min(r["sent"] for r in ok) if ok else 0.0
        with open(args.dump, "w") as f:
            for r in sorted(ok, key=lambda r: r["sent"]):
                rec = {"sent_s": r["sent"] - first, "ttft_s": r["ttft"], "latency_s": r["latency"]}
                f.write(json.dumps({k: round(v, 4) for k, v in rec.items()}) + "\n")
    return {
        "benchmark": "serving",
        "base_url": args.base_url,
        "model": args.model,
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "failed": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "wall_s": round(wall, 2),
        "output_tok_s": round(out_tokens / wall, 1),
        "mean_prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in ok), 1) if ok else 0,
        "ttft_p50_s": round(pct([r["ttft"] for r in ok], 50), 3),
        "ttft_p99_s": round(pct([r["ttft"] for r in ok], 99), 3),
        "itl_p50_ms": round(pct(itl, 50) * 1e3, 1),
        "itl_p99_ms": round(pct(itl, 99) * 1e3, 1),
        "client_workers": workers,
        "client_busy_max": round(busy, 2),  # the busiest worker's CPU time / its wall time
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default=None, help="default: the first entry of /v1/models")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128, help="prompt length in words (about tokens)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=0, help="client processes (0: one per 32 streams)")
    ap.add_argument("--dump", default=None, help="JSON lines: each request's send time, TTFT, latency")
    args = ap.parse_args()
    res = run(args)
    print(f"\nconcurrency {res['concurrency']}, {res['num_requests']} requests, {res['failed']} failed")
    print(f"output throughput   {res['output_tok_s']:>8.1f} tok/s   (wall {res['wall_s']} s)")
    print(f"TTFT p50 / p99      {res['ttft_p50_s']:>8.3f} / {res['ttft_p99_s']:.3f} s")
    print(f"ITL  p50 / p99      {res['itl_p50_ms']:>8.1f} / {res['itl_p99_ms']:.1f} ms")
    print(
        f"client              {res['client_workers']} process(es), busiest {res['client_busy_max']:.0%} CPU"
    )
    if res["client_busy_max"] > 0.85:
        print("WARNING: a client process was busy > 85% of the time: the client may have set the pace")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
