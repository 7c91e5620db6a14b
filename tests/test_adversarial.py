"""The adversarial layer: each defect an outside probe found (issue 16), reproduced against a real server,
so it stays fixed. Tiny random models where the model does not matter; the embedded one where its
tokenizer and speed do (the stall test). The fresh-process and SIGTERM cases are in
test_fresh_server.py and test_shutdown.py, slow clients in test_slow_clients.py."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import jsonschema
import pytest

from foveal.config import ServerConfig
from foveal.server.prompts import PixelBudget
from tests.test_server import serving
from tests.test_server_vlm import data_url, img_part, user
from tests.tiny_vlm import build, image, save_tiny_text_model

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_text_model(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def tiny(folder):
    with serving({"model": folder}, {"max_queued_requests": 4}) as s:
        yield s


@pytest.fixture(scope="module")
def trusting(folder):
    with serving({"model": folder}, {"trust_request_chat_template": True, "input_timeout": 1.0}) as s:
        yield s


def post(s, path, body, **kw):
    return httpx.post(s.url + path, json=body, timeout=kw.pop("timeout", 60), **kw)


# -- 2. one request must not stall everybody ----------------------------------------------------------


@pytest.fixture(scope="module")
def real(smollm_path):
    # the weights `foveal serve` runs (packed Q4_1): the bystander's steps are ~40 ms on the Zen 3 host,
    # not the dense fp32 model's 110-270 ms, so a 0.5 s gap is the heavy input's doing
    with serving({"quantization": "auto"}, {}) as s:
        yield s


async def stream_gaps(c: httpx.AsyncClient, body: dict, gaps: list[float]) -> None:
    """Stream a chat completion, appending the seconds between content deltas to `gaps`."""
    last = None
    async with c.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


@pytest.mark.alone
def test_worst_input_work_does_not_stall_a_stream(real):
    """While one stream decodes, other requests send the heaviest inputs the server takes: a 3.9 MB
    completion prompt (refused on its length, untokenized), the longest text that could still fit
    (tokenized in the input pool, then refused on its token count) and a 3.9 MB chat (rendered, then
    refused). They all fail alone with a 4xx; the stream's tokens keep coming (the probe saw a 10.7 s
    freeze when the model thread tokenized)."""
    proc = real.processor
    longest = ("Rome " * (proc.max_prompt_chars // 5 + 1))[: proc.max_prompt_chars]
    heavy = [
        ("/v1/completions", {"prompt": "x" * 3_900_000, "max_tokens": 1}),
        ("/v1/completions", {"prompt": longest, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 3_900_000}]}),
    ]

    async def main():
        gaps: list[float] = []
        async with httpx.AsyncClient(base_url=real.url, timeout=120) as c:
            body = {**CHAT, "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
            task = asyncio.create_task(stream_gaps(c, body, gaps))
            while len(gaps) < 3:
                await asyncio.sleep(0.01)
            codes, start = [], len(gaps)  # the first gaps hold first-use work (recording a step)
            for path, body in heavy:  # one after another, each while the stream runs
                codes.append((await c.post(path, json=body)).status_code)
            end = len(gaps)
            await task
        return gaps[start : end + 1], end < len(gaps), codes

    gaps, after, codes = asyncio.run(main())
    assert codes == [400, 400, 400]
    assert after, "the stream ended before the heavy inputs were done"
    assert max(gaps) < 0.5, f"a {max(gaps):.2f} s gap between tokens: {gaps}"


def test_request_chat_templates_are_refused_unless_trusted(tiny):
    for body in (
        {**CHAT, "chat_template": "{{ 'x' }}"},
        {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
    ):
        r = post(tiny, "/v1/chat/completions", body)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"]
    r = post(tiny, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and "tokenize" in r.json()["error"]["message"]


def test_a_slow_trusted_template_fails_alone(trusting):
    """Six templates that would render for hours: each a 400 at the input deadline (the render stopped
    in its thread), a normal chat sent while they run succeeds, and afterwards the pool is free. While
    they run, six pure-Python renders hold the GIL most of the time and slow every other thread (the
    model thread's steps too): the deadline is what bounds that, which is why request templates are
    refused unless the operator trusts them."""

    async def main():
        async with httpx.AsyncClient(base_url=trusting.url, timeout=60) as c:
            done: list[str] = []

            async def send(name, body):
                r = await c.post("/v1/chat/completions", json=body)
                done.append(name)
                return r

            slow_body = {**CHAT, "chat_template": SLOW_TEMPLATE}
            slow = [asyncio.create_task(send("slow", slow_body)) for _ in range(6)]
            await asyncio.sleep(0.2)
            normal = await send("normal", CHAT)
            slow = await asyncio.gather(*slow)
            again = await c.post("/v1/chat/completions", json=CHAT)
            return done, normal, slow, again

    done, normal, slow, again = asyncio.run(main())
    assert normal.status_code == 200 and len(done) == 7
    for r in slow:
        assert r.status_code == 400 and r.json()["error"]["code"] == "input_too_slow"
    assert again.status_code == 200
    assert trusting.app.state.inputs.num_timeouts >= 6
    ok = post(trusting, "/v1/chat/completions", {**CHAT, "chat_template": "{{ messages[0]['content'] }}!"})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == len("hi!")


# -- 4. the model thread dying ------------------------------------------------------------------------


class PanicException(BaseException):
    """What pyo3 raises for a Rust panic (a tokenizer's): a BaseException, not an Exception."""


def test_a_panic_in_one_requests_detokenizer_fails_that_request_only(tiny, monkeypatch):
    from foveal.engine import detokenizer

    add = detokenizer.IncrementalDetokenizer.add

    def panicky(self, ids):
        if self.stop == ("PANIC",):  # the marked request
            raise PanicException("called `Option::unwrap()` on a `None` value")
        return add(self, ids)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add", panicky)
    bad = post(tiny, "/v1/completions", {"prompt": "a", "max_tokens": 3, "stop": "PANIC"})
    good = post(tiny, "/v1/completions", {"prompt": "fine", "max_tokens": 3})
    assert bad.status_code == 500 and "PanicException" in bad.json()["error"]["message"]
    assert good.status_code == 200 and httpx.get(tiny.url + "/health").json()["status"] == "ready"


def test_the_model_thread_dying_ends_every_stream_and_marks_the_server_dead(folder):
    with serving({"model": folder}, {}) as s:
        eng = s.engine
        step = eng.step
        calls = [0]

        def dying():
            calls[0] += 1
            if calls[0] == 4:
                raise PanicException("the tokenizer panicked")
            return step()

        eng.step = dying
        body = {**CHAT, "max_tokens": 50, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = [x for x in r.iter_lines() if x]
        assert '"error"' in lines[-2] and "PanicException" in lines[-2] and lines[-1] == "data: [DONE]"
        h = httpx.get(s.url + "/health")
        assert h.status_code == 503 and h.json()["status"] == "dead" and "panicked" in h.json()["error"]
        r = post(s, "/v1/chat/completions", CHAT, timeout=10)  # no hang: refused at once
        assert r.status_code == 503 and "panicked" in r.json()["error"]["message"]


# -- 5, 8, 9: bad bodies and edges --------------------------------------------------------------------


def test_deep_json_and_lone_surrogates_are_400s(tiny):
    deep = "[" * 10_000 + "]" * 10_000
    r = httpx.post(tiny.url + "/v1/chat/completions", content=deep, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    raw = '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    r = httpx.post(tiny.url + "/v1/chat/completions", content=raw, timeout=30)
    assert r.status_code == 400 and "surrogate (\\ud800)" in r.json()["error"]["message"]
    raw = '{"prompt": "a\\ud83d\\ude00b", "max_tokens": 2}'  # a proper pair is text
    assert httpx.post(tiny.url + "/v1/completions", content=raw, timeout=30).status_code == 200


def test_a_client_leaving_mid_body_is_one_info_line(tiny, caplog):
    with caplog.at_level(logging.INFO):
        with socket.create_connection(("127.0.0.1", int(tiny.url.rsplit(":", 1)[1]))) as sk:
            sk.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"m')
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while not any("client left mid-body" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "no INFO line for the client that left"
            time.sleep(0.05)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


def test_edges(tiny):
    r = post(tiny, "/v1/completions", {"prompt": "a", "n": 5, "max_tokens": 2})
    assert r.status_code == 400 and "queues at most 4" in r.json()["error"]["message"]  # never fits: no 429
    for field, value in (("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto")):
        r = post(tiny, "/v1/chat/completions", {**CHAT, field: value})
        msg = r.json()["error"]["message"]
        assert r.status_code == 400 and msg.startswith(f"unsupported parameter '{field}'")
    r = httpx.get(tiny.url + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = post(tiny, "/v1/chat/completions", {**CHAT, "max_tokens": 5.0, "ignore_eos": True, "n": 1.0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert post(tiny, "/v1/chat/completions", {**CHAT, "max_tokens": 5.5}).status_code == 400
    assert post(tiny, "/v1/chat/completions", {**CHAT, "max_tokens": True}).status_code == 400


def test_continue_final_message(tiny):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": msgs, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True}
    r = post(tiny, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    want = tiny.processor.apply_chat_template(msgs, add_generation_prompt=False, continue_final_message=True)
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert tiny.processor.tokenizer.decode(want).endswith("Once upon")  # left open for the model to go on
    r = post(tiny, "/v1/chat/completions", {**body, "add_generation_prompt": True})
    assert r.status_code == 400 and "add_generation_prompt=false" in r.json()["error"]["message"]
    r = post(tiny, "/v1/chat/completions", {**body, "messages": msgs[:1]})
    assert r.status_code == 400 and "assistant" in r.json()["error"]["message"]


def test_safe_defaults():
    """A bounded queue and a request timeout by default, in the config and in `foveal serve`'s flags."""
    from foveal.cli import build_parser

    cfg = ServerConfig()
    assert cfg.max_queued_requests == 1024 and cfg.request_timeout == 600.0
    assert not cfg.trust_request_chat_template
    a = build_parser().parse_args(["serve"])
    assert (a.max_queued_requests, a.request_timeout, a.input_timeout) == (1024, 600.0, 10.0)
    assert (a.header_timeout, a.body_timeout, a.max_connections) == (10.0, 30.0, 1024)
    assert not a.trust_request_chat_template


# -- 6. images ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    tiny = build("llava", str(tmp_path_factory.mktemp("llava")))
    kw = {"max_request_image_pixels": 5000, "max_image_pixels_in_flight": 8000, "image_queue_timeout": 0.3}
    with serving({"model": tiny.path}, kw) as s:
        yield s


def test_image_pixels_are_budgeted_per_request_and_in_flight(vlm):
    one = img_part(data_url(image(60, 40, 1)))  # 2,400 pixels
    body = {"messages": user("What?", one), "max_tokens": 2}
    assert post(vlm, "/v1/chat/completions", body).status_code == 200
    r = post(vlm, "/v1/chat/completions", {**body, "messages": user("What?", one, one, one)})
    assert r.status_code == 413 and r.json()["error"]["code"] == "images_too_large"
    budget: PixelBudget = vlm.app.state.prompts.pixels
    budget.in_use = 7000  # as if other requests' 7,000 of 8,000 pixels were in flight
    try:  # 2,400 more must wait, then be refused
        r = post(vlm, "/v1/chat/completions", body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
    finally:
        budget.in_use = 0
    assert post(vlm, "/v1/chat/completions", body).status_code == 200
    assert budget.in_use == 0


def test_pixel_budget_waits_then_refuses():
    async def main():
        b = PixelBudget(10)
        assert await b.acquire(8, 0.1)
        assert not await b.acquire(5, 0.05)  # would pass the capacity: refused after the wait
        waiter = asyncio.create_task(b.acquire(5, 1.0))
        await asyncio.sleep(0.05)
        await b.release(8)
        assert await waiter and b.in_use == 5

    asyncio.run(main())


# -- 10. the served OpenAPI document ------------------------------------------------------------------


def test_openapi_publishes_the_validated_request_bodies(tiny):
    doc = httpx.get(tiny.url + "/openapi.json").json()
    bodies = (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}))
    for path, good in bodies:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        resolver = {**schema, "components": doc["components"]}
        jsonschema.validate(good, resolver)
        assert post(tiny, path, good).status_code == 200
        bad = {**good, "max_tokens": "three"}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, resolver)
        assert post(tiny, path, bad).status_code == 400
        assert set(doc["paths"][path]["post"]["responses"]) >= {"200", "400", "413", "429"}
    assert json.dumps(doc).count("#/components/schemas/ChatMessage") >= 1


def test_the_vision_cache_is_per_tenant(tmp_path_factory):
    """The same picture from two tenants: each encodes it once (a shared encoder output would tell one
    tenant, by timing, that another sent that image)."""
    tiny = build("llava", str(tmp_path_factory.mktemp("llava_tenants")))
    keys = (("sk-a", "a", False), ("sk-b", "b", False))
    with serving({"model": tiny.path}, {"api_keys": keys}) as s:
        body = {"messages": user("What?", img_part(data_url(image(40, 30, 7)))), "max_tokens": 2}
        cache = s.engine.encoder_cache
        seen = []
        for key in ("sk-a", "sk-a", "sk-b", "sk-b"):
            r = post(s, "/v1/chat/completions", body, headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
            st = cache.stats()
            seen.append((st.hits, st.misses))
        # a's repeat reuses its prefix-cached K/V (no encoding at all); b shares neither the K/V nor
        # the encoder output: it encodes the image itself (unsalted, that was a vision-cache hit)
        assert seen == [(0, 1), (0, 1), (0, 2), (0, 2)]


def test_a_client_that_leaves_counts_as_aborted_not_failed(tiny):
    before = httpx.get(tiny.url + "/v1/metrics").json()["summary"]
    body = {**CHAT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tiny.url + "/v1/chat/completions", json=body, timeout=30) as r:
        next(line for line in r.iter_lines() if '"content":"' in line and '"content":""' not in line)
    deadline = time.monotonic() + 10
    while True:
        after = httpx.get(tiny.url + "/v1/metrics").json()["summary"]
        if after["requests_aborted"] > before["requests_aborted"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    for k in ("requests_failed", "last_error"):
        assert after[k] == before[k], k
