"""SIGTERM on a `foveal serve` process (its own process: signals are the main thread's): requests that
finish within --drain-timeout finish normally; at the deadline every one still open gets a proper
final event (streamed: an error event, then [DONE]; whole: a JSON 503); /health says "draining"
while it lasts and new requests get a 503. uvicorn alone cut such streams off with no final event and
answered whole ones with a text/plain 500."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from tests.spawned import spawn_server

pytestmark = pytest.mark.slow

LONG = {
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 3000,
    "ignore_eos": True,
    "temperature": 0,
}


def test_sigterm_drains_then_ends_open_requests_with_a_final_event(smollm_path):
    async def main(s):
        async with httpx.AsyncClient(base_url=s.url, timeout=120) as c:
            started = asyncio.Event()

            async def streamed():
                lines = []
                async with c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line:
                            lines.append(line)
                            if len(lines) == 3:
                                started.set()
                return r.status_code, lines

            async def short():
                await started.wait()
                body = {**LONG, "max_tokens": 12, "stream": True}
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line]

            a = asyncio.create_task(streamed())
            b = asyncio.create_task(c.post("/v1/chat/completions", json=LONG))
            await asyncio.wait_for(started.wait(), 60)
            d = asyncio.create_task(short())
            await asyncio.sleep(0.3)  # the short one is admitted before the signal
            s.proc.send_signal(signal.SIGTERM)
            health, refused = None, None
            deadline = time.monotonic() + 2.5  # inside the 3 s drain
            while time.monotonic() < deadline and (health is None or refused is None):
                h = await c.get("/health")
                if h.json()["status"] == "draining":
                    health = h
                    refused = await c.post("/v1/chat/completions", json={**LONG, "max_tokens": 2})
                await asyncio.sleep(0.05)
            return await a, await b, await d, health, refused

    with spawn_server("--drain-timeout", "3") as s:
        (a_status, a_lines), b, d_lines, health, refused = asyncio.run(main(s))
        rc = s.proc.wait(30)
        log = s.log()
    assert health is not None and health.status_code == 503, "/health never said draining"
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    # the short request finished normally during the drain
    assert any('"finish_reason":"length"' in x for x in d_lines) and d_lines[-1] == "data: [DONE]"
    # the long stream: an error event, then [DONE]
    assert a_status == 200 and a_lines[-1] == "data: [DONE]", a_lines[-3:]
    assert '"error"' in a_lines[-2] and "shutting down" in a_lines[-2]
    # the long whole request: a JSON 503
    assert b.status_code == 503 and "shutting down" in b.json()["error"]["message"]
    assert "Cancel" not in log and "Traceback" not in log, log[-3000:]
    assert rc in (0, -signal.SIGTERM), rc


def test_ctrl_c_stops_the_server_without_a_traceback(smollm_path):
    """SIGINT (Ctrl-C) drains like SIGTERM and the process ends with status 0 and no traceback (uvicorn
    re-raises the signal it stopped on as a KeyboardInterrupt)."""
    with spawn_server("--drain-timeout", "1") as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={**LONG, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
        rc = s.stop(signal.SIGINT)
        log = s.log()
    assert rc == 0 and "Traceback" not in log, (rc, log[-3000:])
