"""A fresh `foveal serve` process on the embedded model (the defaults `make serve` runs), hit at once by
concurrent streams of every decode-bucket size. First-use work happens here and nowhere else: the first
recorded step of each bucket (worker/cpu_graphs.py), the LM head's first packed GEMM (4+ rows), the
kernels' first calls. A session-8 server failed its first 4-row decode step (the packed weight was made
inside the recording) and every request in that batch ended in an error."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from foveal.worker.cpu_graphs import MAX_ROWS
from foveal.worker.cuda_graphs import batch_buckets
from tests.spawned import spawn_server

pytestmark = pytest.mark.slow


async def _stream(
    client: httpx.AsyncClient, i: int, max_tokens: int, decoding: asyncio.Event | None = None
) -> tuple[str | None, str]:
    body = {
        "messages": [{"role": "user", "content": f"Tell me about the number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    reason, events = None, []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(line)
                if decoding is not None and len(events) == 2:  # the role chunk, then a token
                    decoding.set()
                if '"error"' in line:
                    return "error", line
                if '"finish_reason":"' in line:
                    reason = line.split('"finish_reason":"')[1].split('"')[0]
    return reason, events[-1] if events else ""


def test_fresh_server_serves_every_bucket_size_from_its_first_step(smollm_path):
    # one stream decoding, then 2 more: 3 rows, padded to bucket 4, whose first step is recorded before
    # any eager step had 4 logit rows (the report's case); then a wave of every bucket size
    sizes = [2] + batch_buckets(MAX_ROWS)

    async def main(url):
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            # one stream already decoding when the others arrive, as in the report
            decoding = asyncio.Event()
            first = asyncio.create_task(_stream(c, 0, 30, decoding))
            await asyncio.wait_for(decoding.wait(), 60)
            out = {}
            for n in sizes:
                out[n] = await asyncio.gather(*(_stream(c, 100 * n + i, 4) for i in range(n)))
            return [await first], out

    with spawn_server() as s:
        first, waves = asyncio.run(main(s.url))
        log = s.log()
    assert first[0][0] == "length", first
    for n, results in waves.items():
        bad = [r for r in results if r[0] != "length"]
        assert not bad, f"{len(bad)} of {n} concurrent streams failed: {bad[0]}"
    assert "forward pass failed" not in log and "recording failed" not in log, log[-3000:]
