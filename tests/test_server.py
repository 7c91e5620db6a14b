"""The OpenAI-compatible server end to end: a real uvicorn server on 127.0.0.1 (random port) on the
embedded model, driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import openai
import pytest
import uvicorn

from foveal.config import EngineConfig, ServerConfig
from foveal.engine.engine import Engine
from foveal.engine.factory import build_engine
from foveal.engine.input_processor import InputProcessor
from foveal.server.app import create_app

KEY = "sk-test-123"
Q = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Served:
    url: str
    engine: Engine
    processor: InputProcessor
    app: object
    server: uvicorn.Server

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw
        )

    @property
    def model(self) -> str:
        return self.processor.info.model_name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(engine_kw: dict, server_kw: dict):
    engine, processor = build_engine(
        # the dense weights unless a test asks: the expected answers are the dense model's
        EngineConfig.from_kwargs(
            **{"dtype": "float32", "quantization": "none", "kv_cache_memory": 128 * 2**20, **engine_kw}
        )
    )
    app = create_app(engine, processor, ServerConfig(drain_timeout=1.0, **server_kw))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and th.is_alive(), "server did not start"
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{port}", engine, processor, app, server), th


@contextmanager
def serving(engine_kw: dict, server_kw: dict):
    """_serve as a context: the server stops at the end, however the block ends."""
    s, th = _serve(engine_kw, server_kw)
    try:
        yield s
    finally:
        s.server.should_exit = True
        th.join(15)


@pytest.fixture(scope="module")
def srv(smollm_path):
    with serving({}, {}) as s:
        yield s


@pytest.fixture(scope="module")
def small(smollm_path):
    """One running sequence, one waiting, an API key: for 429 and auth."""
    with serving({"max_num_seqs": 1}, {"max_queued_requests": 1, "api_key": KEY}) as s:
        yield s


def _free_soon(engine, within=3.0):
    # a few engine steps' worth: a 2-core CI box shared with other work can make one step slow
    deadline = time.monotonic() + within
    while engine.kv.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.kv.num_used_blocks == 0, "KV blocks still busy"
    engine.kv.check_integrity()


def test_models_health_and_chat_usage(srv):
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ready"
    c = srv.client()
    assert [m.id for m in c.models.list().data] == [srv.model]
    raw = c.chat.completions.with_raw_response.create(
        model=srv.model, messages=Q, temperature=0, max_tokens=8
    )
    r = raw.parse()
    assert raw.headers["x-request-id"] == r.id and r.id.startswith("chatcmpl-")
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.startswith("The capital of France is")
    n_prompt = len(srv.processor.apply_chat_template(Q))
    u = r.usage
    assert (u.prompt_tokens, u.total_tokens) == (n_prompt, n_prompt + u.completion_tokens)
    assert u.prompt_tokens_details.cached_tokens == 0
    # multi-part text content and a system message render like the plain string
    parts = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is the capital "},
                {"type": "text", "text": "of France?"},
            ],
        },
    ]
    plain = [{"role": "system", "content": "Be brief."}, Q[0]]
    a = c.chat.completions.create(model=srv.model, messages=parts, temperature=0, max_tokens=6)
    b = c.chat.completions.create(model=srv.model, messages=plain, temperature=0, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_stream_equals_whole_and_seed_reproducible(srv):
    c = srv.client()
    kw = dict(model=srv.model, messages=Q, temperature=0.9, seed=11, max_tokens=12)
    whole = c.chat.completions.create(**kw)
    again = c.chat.completions.create(**kw)
    assert whole.choices[0].message.content == again.choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # completions: same equality, plain prompt
    ckw = dict(model=srv.model, prompt="Once upon a time", temperature=0.7, seed=3, max_tokens=10)
    w = c.completions.create(**ckw)
    s = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **ckw) if ch.choices)
    assert s == w.choices[0].text and w.object == "text_completion" and w.usage.completion_tokens == 10


def test_raw_sse_shape_ends_with_done(srv):
    body = {"model": srv.model, "messages": Q, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    first = json.loads(lines[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant",
        "content": "",
    }
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"


def test_n2_stop_and_logprobs(srv):
    c = srv.client()
    r = c.chat.completions.create(model=srv.model, messages=Q, n=2, temperature=1.0, seed=4, max_tokens=6)
    assert [ch.index for ch in r.choices] == [0, 1]
    reasons = [ch.finish_reason for ch in r.choices]
    assert set(reasons) <= {"length", "stop"}, reasons
    # a choice cut by length has its 6 tokens, one that stopped at least one (the EOS)
    assert 6 * reasons.count("length") + reasons.count("stop") <= r.usage.completion_tokens <= 12
    r = c.chat.completions.create(model=srv.model, messages=Q, temperature=0, max_tokens=20, stop=["Paris"])
    assert (
        r.choices[0].message.content == "The capital of France is " and r.choices[0].finish_reason == "stop"
    )
    r = c.chat.completions.create(
        model=srv.model, messages=Q, temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    r = c.completions.create(model=srv.model, prompt="The sky is", temperature=0, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 3 and all(len(t) >= 1 for t in lp.top_logprobs) and lp.text_offset[0] == 0


def test_extras_and_logit_bias(srv):
    c = srv.client()
    ids = srv.processor.tokenize(" Berlin", add_special_tokens=False)
    r = c.chat.completions.create(
        model=srv.model,
        messages=Q,
        temperature=0,
        max_tokens=6,
        logit_bias={str(ids[0]): 100},
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u1",
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "ignore_eos": True,
            "chat_template_kwargs": {},
        },
    )
    assert r.usage.completion_tokens == 6 and "Berlin" in r.choices[0].message.content


def test_concurrent_streams_then_pool_empty(srv):
    async def one(c, i):
        stream = await c.chat.completions.create(
            model=srv.model,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            temperature=0.5,
            seed=i,
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for ch in stream:
            usage = ch.usage or usage
        return usage

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        return await asyncio.gather(*[one(c, i) for i in range(32)])

    usages = asyncio.run(main())
    assert all(u.completion_tokens == 8 and u.total_tokens == u.prompt_tokens + 8 for u in usages)
    _free_soon(srv.engine)


@pytest.mark.parametrize("after_chunks", [1, 3])
def test_disconnect_frees_blocks(srv, after_chunks):
    body = {"model": srv.model, "messages": Q, "max_tokens": 300, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        it = r.iter_lines()
        got = 0
        # the role chunk can reach us before the engine has scheduled the request: read on until it
        # holds blocks (300 tokens take far longer than the few chunks this allows)
        while got < after_chunks or (srv.engine.kv.num_used_blocks == 0 and got < after_chunks + 5):
            got += bool(next(it))
        assert srv.engine.kv.num_used_blocks > 0
    _free_soon(srv.engine)


def test_disconnect_during_prefill_frees_blocks(srv):
    """The client leaves after the role chunk, while a ~1,200-token prompt is still being prefilled:
    the abort lands between engine steps and the blocks are free within that step."""
    prompt = "Tell me about " + "the sea and the sky, " * 200
    body = {
        "model": srv.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 50,
        "stream": True,
    }
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
        first = next(line for line in r.iter_lines() if line)
        assert '"role"' in first and '"assistant"' in first  # admitted, stream started
    _free_soon(srv.engine, within=15.0)
    # the role chunk can precede admission: then the prefill step starts after we looked; let it end so
    # the next test does not queue behind a multi-second step
    deadline = time.monotonic() + 15.0
    while srv.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    _free_soon(srv.engine)


def test_prompt_too_long_is_400_before_stream(srv):
    body = {"model": srv.model, "messages": Q, "max_tokens": 10**6, "stream": True}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    body = {"model": srv.model, "prompt": [1] * (srv.processor.info.max_model_len + 5), "stream": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


M = {"model": None, "messages": Q, "max_tokens": 2}
BAD = [
    ("chat", b"{not json", "JSON"),
    ("chat", b"[1, 2]", "JSON object"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"max_tokens": 2}, "messages"),
    ("chat", {**M, "tools": [{"type": "function"}]}, "tools"),
    ("chat", {**M, "response_format": {"type": "xml"}}, "response_format"),
    ("chat", {**M, "temperature": "hot"}, "temperature"),
    ("chat", {**M, "temperature": 3.0}, "temperature"),
    ("chat", {**M, "top_p": 0}, "top_p"),
    ("chat", {**M, "n": 0}, "n"),
    ("chat", {**M, "max_tokens": 0}, "max_tokens"),
    ("chat", {**M, "max_tokens": 10**7}, "max_tokens"),
    ("chat", {**M, "presence_penalty": 5}, "presence_penalty"),
    ("chat", {**M, "repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {**M, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {**M, "frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {**M, "logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {**M, "logit_bias": {"999999999": 1}}, "logit_bias"),
    ("chat", {**M, "logit_bias": {"5": 500}}, "logit_bias"),
    ("chat", {**M, "top_logprobs": 3}, "top_logprobs"),
    ("chat", {**M, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("chat", {**M, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("chat", {**M, "messages": [{"role": "user"}]}, "content"),
    (
        "chat",
        {**M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "content.0.image_url.url'",
    ),
    ("chat", {**M, "stream": "yes"}, "stream"),
    ("chat", {**M, "stop": [""]}, "stop"),
    ("chat", {**M, "seed": 1.5}, "seed"),
    ("chat", {**M, "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("chat", {**M, "model": "gpt-4"}, "gpt-4"),
    ("chat", {**M, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ("cmpl", {"prompt": 5}, "prompt"),
    ("cmpl", {"prompt": ""}, "empty"),
    ("cmpl", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("cmpl", {"prompt": "hi", "echo": True}, "echo"),
    ("cmpl", {"prompt": [-1, 5]}, "token ids"),
]


def test_bad_inputs_are_4xx_naming_the_problem(srv):
    for route, body, needle in BAD:
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        if isinstance(body, dict):
            body = {k: v for k, v in body.items() if not (k == "model" and v is None)}
            content = json.dumps(body).encode()
        else:
            content = body
        r = httpx.post(srv.url + path, content=content, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert needle.lower() in err["message"].lower(), (body, err)
    r = httpx.post(srv.url + "/v1/chat/completions", json={**M, "model": "gpt-4"})
    assert r.status_code == 404
    r = httpx.post(srv.url + "/v1/completions", content=b"x" * (5 * 2**20))
    assert r.status_code == 413
    assert httpx.get(srv.url + "/v1/nope").status_code == 404
    r = srv.client().chat.completions.create(model=srv.model, messages=Q, temperature=0, max_tokens=2)
    assert r.choices[0].message.content
    _free_soon(srv.engine)


def test_sampling_errors_name_their_field(srv):
    """A bad sampling value is refused once, by SamplingParams, and the 400's `param` names the field."""
    for body, param in [
        ({**M, "temperature": 3.0}, "temperature"),
        ({**M, "n": 17}, "n"),
        ({**M, "logit_bias": {"999999999": 1}}, "logit_bias"),
        ({**M, "stop": ["x"] * 17}, "stop"),
        ({**M, "top_logprobs": 3}, "top_logprobs"),
        ({**M, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({**M, "max_completion_tokens": 0}, "max_completion_tokens"),
        ({**M, "repetition_penalty": 0}, "repetition_penalty"),
    ]:
        body = {k: v for k, v in body.items() if v is not None}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_input_work_never_runs_on_the_model_thread(srv, monkeypatch):
    """Templating, tokenizing and request validation (the InputProcessor) run in the input pool; the
    model thread receives EngineRequests only."""
    seen: dict[str, set] = {}

    def spy(obj, name):
        orig = getattr(obj, name)

        def wrapped(*a, **kw):
            seen.setdefault(name, set()).add(threading.current_thread().name)
            return orig(*a, **kw)

        monkeypatch.setattr(obj, name, wrapped)

    tok = srv.processor.tokenizer
    spy(tok, "encode")
    spy(tok, "apply_chat_template")
    spy(srv.processor, "request")
    spy(srv.engine, "add_request")
    c = srv.client()
    c.chat.completions.create(model=srv.model, messages=Q, max_tokens=2, n=2)
    c.completions.create(model=srv.model, prompt=["Once upon", "a time"], max_tokens=2)
    assert set(seen) == {"encode", "apply_chat_template", "request", "add_request"}
    for name in ("encode", "apply_chat_template", "request"):
        assert all(t.startswith("foveal-input") for t in seen[name]), (name, seen[name])
    assert seen["add_request"] == {"foveal-engine"}


def test_fault_in_one_request_leaves_others_intact(srv, monkeypatch):
    from foveal.engine.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add

    def add(self, ids):
        if "@@boom@@" in self.stop:
            raise RuntimeError("injected fault")
        return real(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add", add)

    async def main():
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        good = c.chat.completions.create(model=srv.model, messages=Q, temperature=0, max_tokens=8)
        bad = c.chat.completions.create(model=srv.model, messages=Q, max_tokens=8, stop=["@@boom@@"])
        return await asyncio.gather(good, bad, return_exceptions=True)

    good, bad = asyncio.run(main())
    assert good.choices[0].message.content.startswith("The capital")
    assert isinstance(bad, openai.InternalServerError) and "injected fault" in str(bad)
    _free_soon(srv.engine)


def test_metrics(srv):
    text = httpx.get(srv.url + "/metrics").text
    for series in (
        "foveal_requests_total",
        "foveal_time_to_first_token_seconds_bucket",
        "foveal_inter_token_latency_seconds_bucket",
        "foveal_e2e_request_latency_seconds_bucket",
        "foveal_prompt_tokens_total",
        "foveal_generation_tokens_total",
        "foveal_num_requests_running",
        "foveal_num_requests_waiting",
        "foveal_kv_cache_usage_ratio",
    ):
        assert series in text, series
    m = httpx.get(srv.url + "/v1/metrics").json()
    assert m["summary"]["requests_completed"] >= 1 and m["summary"]["requests_in_flight"] == 0
    for k in ("ttft_s", "prefill_tokens_per_s", "decode_tokens_per_s", "request_time_s", "finish_reason"):
        assert k in m["latest"]


def test_a_stopped_server_lets_its_engine_go(smollm_path):
    """After the app's shutdown nothing holds its engine (weights, KV pool): FastAPI keeps route
    functions in module-level caches past an app's life, and the routes close over the engine loop."""
    import gc
    import weakref

    with serving({}, {}) as s:
        engine = weakref.ref(s.engine)
        r = s.client().completions.create(model=s.model, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
    del s
    gc.collect()
    assert engine() is None


def test_auth(small):
    h = httpx.get(small.url + "/health")
    assert h.status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.get(small.url + "/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(small.url + "/metrics").status_code == 401
    ok = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(small.url + "/v1/models", headers=ok).status_code == 200
    assert httpx.get(small.url + "/metrics", headers=ok).status_code == 200


def test_queue_full_is_429(small):
    c = small.client(api_key=KEY)
    long = {"model": small.model, "messages": Q, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream(
        "POST", small.url + "/v1/chat/completions", json=long, headers={"Authorization": f"Bearer {KEY}"}
    ) as running:
        it = running.iter_lines()
        while not next(it):  # wait for the role chunk: the first request is admitted
            pass
        while not next(it):  # a content chunk: it is running now
            pass
        with httpx.stream(
            "POST", small.url + "/v1/chat/completions", json=long, headers={"Authorization": f"Bearer {KEY}"}
        ) as waiting:
            it2 = waiting.iter_lines()  # keep a reference: a collected iterator closes the stream
            next(it2)  # its role chunk: admitted, waiting behind the running one
            with pytest.raises(openai.RateLimitError) as e:
                c.chat.completions.create(model=small.model, messages=Q, max_tokens=2)
            assert e.value.response.headers["retry-after"] == "1"
    _free_soon(small.engine, within=2.0)
    r = c.chat.completions.create(model=small.model, messages=Q, temperature=0, max_tokens=2)
    assert r.choices[0].message.content


def test_completions_with_several_prompts(srv):
    """A list of prompts: n choices each, numbered prompt * n + choice, prompt tokens counted once per
    prompt; each choice equals the same prompt sent alone (greedy)."""
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    prompts = ["The capital of France is", "One, two, three,"]
    r = c.completions.create(model=srv.model, prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [ch.index for ch in sorted(r.choices, key=lambda ch: ch.index)] == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in r.choices}
    singles = [c.completions.create(model=srv.model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert by_index[0] == by_index[1] == singles[0].choices[0].text
    assert by_index[2] == by_index[3] == singles[1].choices[0].text
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens + singles[1].usage.prompt_tokens
    assert r.usage.completion_tokens == 2 * sum(x.usage.completion_tokens for x in singles)
    ids = [[1, 2, 3], [4, 5]]
    r = c.completions.create(
        model=srv.model,
        prompt=ids,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(r)
    assert {ch.choices[0].index for ch in chunks if ch.choices} == {0, 1}
    assert chunks[-1].usage.prompt_tokens == 5
    _free_soon(srv.engine)
