"""Prefix caching over HTTP: tenant isolation bound to the API key, client salts only when the operator
allows them, cached tokens in usage, GET /v1/cache/stats, POST /v1/cache/reset (admin only), and the
Prometheus hit counters. A tiny random Llama with a byte tokenizer: the cache does not care about quality."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.test_server import _serve
from tests.tiny_vlm import save_tiny_text_model

KEYS = (("sk-alice", "alice", False), ("sk-bob", "bob", False), ("sk-admin", "ops", True))
PROMPT = "The shared system prompt is long enough to fill several blocks of the KV cache. " * 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_text_model(str(tmp_path_factory.mktemp("tiny")))


def serve(folder, **server_kw):
    return _serve({"model": folder}, {"api_keys": KEYS, **server_kw})


@pytest.fixture(scope="module")
def strict(folder):
    s, th = serve(folder)
    yield s
    s.server.should_exit = True
    th.join(15)


@pytest.fixture(scope="module")
def salted(folder):
    s, th = serve(folder, allow_client_cache_salt=True)
    yield s
    s.server.should_exit = True
    th.join(15)


def cached(s, key: str, prompt: str = PROMPT, **extra) -> tuple[int, int]:
    headers = {"Authorization": f"Bearer {key}", **extra.pop("headers", {})}
    r = httpx.post(
        s.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra},
        headers=headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


def test_keys_are_isolated_and_reuse_within_a_key(strict):
    assert cached(strict, "sk-alice")[0] == 0
    hit, n = cached(strict, "sk-alice")
    bs = strict.engine.kv.block_size
    assert hit == (n - 1) // bs * bs > 0  # every full block but the one holding the last token
    assert cached(strict, "sk-bob")[0] == 0  # same prompt, other tenant: nothing shared
    assert cached(strict, "sk-bob")[0] == hit


def test_client_salt_is_ignored_unless_allowed(strict, salted):
    p = PROMPT + "strict"
    cached(strict, "sk-alice", p)
    # not allowed: the salt changes nothing, alice still hits her own cache
    assert cached(strict, "sk-alice", p, cache_salt="other")[0] > 0
    assert cached(strict, "sk-alice", p, headers={"X-Tenant-Id": "other"})[0] > 0
    q = PROMPT + "salted"
    cached(salted, "sk-alice", q, cache_salt="team-1")
    assert cached(salted, "sk-alice", q, cache_salt="team-1")[0] > 0
    assert cached(salted, "sk-alice", q, cache_salt="team-2")[0] == 0
    assert cached(salted, "sk-alice", q, headers={"X-Tenant-Id": "team-3"})[0] == 0
    # a client salt never reaches into another tenant's cache
    assert cached(salted, "sk-bob", q, cache_salt="team-1")[0] == 0


def test_cache_stats_reset_and_prometheus(strict):
    p = PROMPT + "stats"
    cached(strict, "sk-alice", p)
    assert cached(strict, "sk-alice", p)[0] > 0
    h, admin = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-admin"}
    st = httpx.get(strict.url + "/v1/cache/stats", headers=admin).json()["prefix_cache"]
    assert st["enabled"] and st["hit_tokens"] > 0 and st["query_tokens"] >= st["hit_tokens"]
    assert st["cached_blocks"] > 0 and 0 < st["hit_rate"] <= 1 and "evictions" in st
    r = httpx.post(strict.url + "/v1/cache/reset", headers=h)
    assert r.status_code == 403 and "admin" in r.json()["error"]["message"]
    r = httpx.post(strict.url + "/v1/cache/reset", headers=admin)
    assert r.status_code == 200 and r.json()["prefix_blocks_dropped"] > 0
    st = httpx.get(strict.url + "/v1/cache/stats", headers=admin).json()["prefix_cache"]
    assert st["cached_blocks"] == 0
    assert cached(strict, "sk-alice", p)[0] == 0  # after the reset: recomputed
    prom = httpx.get(strict.url + "/metrics", headers=admin).text
    assert "foveal_prefix_cache_hits_total" in prom and "foveal_prefix_cache_queries_total" in prom
    assert httpx.get(strict.url + "/metrics", headers=h).status_code == 403  # global figures: admins
    assert strict.engine.kv.num_used_blocks == 0


def test_chat_usage_reports_cached_tokens_streaming(strict):
    body = {
        "messages": [{"role": "system", "content": PROMPT}, {"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    h = {"Authorization": "Bearer sk-bob"}
    for expect_hit in (False, True):
        with httpx.stream("POST", strict.url + "/v1/chat/completions", json=body, headers=h) as r:
            lines = [x for x in r.iter_lines() if x.startswith("data: {")]
        usage = json.loads(lines[-1][6:])["usage"]
        assert (usage["prompt_tokens_details"]["cached_tokens"] > 0) == expect_hit


def test_access_log_carries_the_request_id(strict, caplog):
    caplog.set_level("INFO", logger="foveal.access")
    r = httpx.post(
        strict.url + "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer sk-bob"},
    )
    rid = r.headers["x-request-id"]
    assert rid.startswith("cmpl-") and r.json()["id"] == rid
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "foveal.access"]
    assert any(line.startswith(rid) and '"POST /v1/completions" 200' in line for line in lines), lines
    httpx.get(strict.url + "/v1/models")  # no key: 401, logged too
    assert any('"GET /v1/models" 401' in rec.getMessage() for rec in caplog.records)


SYSTEM = "You are the shared assistant of every tenant; this system prompt fills several blocks. " * 2


def chat_cached(s, key: str, user: str) -> tuple[int, int]:
    r = httpx.post(
        s.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
            "max_tokens": 2,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    return u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]


def test_shared_prefix_cache_shares_only_the_system_prompt_and_only_when_enabled(folder, strict):
    """--shared-prefix-cache: a second tenant reuses the full blocks of the same system prompt and
    nothing after it (its user turn is its own); without the flag nothing crosses tenants."""
    bs = strict.engine.kv.block_size
    proc = strict.processor
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x"}]
    sys_len = proc.system_prefix_len(chat, proc.apply_chat_template(chat))
    assert sys_len > 2 * bs  # the byte tokenizer's template renders the system turn as a token prefix
    assert chat_cached(strict, "sk-alice", "hello there")[0] == 0
    assert chat_cached(strict, "sk-bob", "hello there")[0] == 0  # not enabled: isolated
    shared, th = serve(folder, shared_prefix_cache=True)
    try:
        assert chat_cached(shared, "sk-alice", "first question")[0] == 0
        hit, _ = chat_cached(shared, "sk-bob", "first question")  # same text, other tenant
        assert hit == sys_len // bs * bs  # the system prompt's full blocks, not the user turn
        assert chat_cached(shared, "sk-alice", "first question")[0] > hit  # her own turn: all of it
    finally:
        shared.server.should_exit = True
        th.join(15)


def test_stats_and_metrics_are_scoped_to_the_callers_tenant(strict):
    """A non-admin key sees its own tenant's requests and counters, never another's request ids,
    prompt sizes or cache hits; an admin key sees everything."""
    carol = PROMPT + "carol's own prompt, long enough to be told apart by its length " * 2
    ids = {}
    for key in ("sk-alice", "sk-bob"):
        r = httpx.post(
            strict.url + "/v1/completions",
            json={"prompt": carol if key == "sk-bob" else PROMPT, "max_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200
        ids[key] = r.json()["id"]

    def get(path, key):
        r = httpx.get(strict.url + path, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()

    mine = get("/v1/metrics", "sk-alice")
    text = json.dumps(mine)
    assert ids["sk-alice"] in text and ids["sk-bob"] not in text
    assert "num_running" not in mine["summary"] and "kv_cache_usage" not in mine["summary"]
    assert mine["summary"]["requests_completed"] >= 1
    everything = json.dumps(get("/v1/metrics", "sk-admin"))
    assert ids["sk-alice"] in everything and ids["sk-bob"] in everything
    st = get("/v1/cache/stats", "sk-bob")["prefix_cache"]
    assert st["scope"] == "tenant" and "cached_blocks" not in st and "free_blocks" not in st
    bob = get("/v1/metrics", "sk-bob")["summary"]
    assert st["query_tokens"] == bob["prompt_tokens"] and st["hit_tokens"] == bob["cached_prompt_tokens"]
    assert "vision_cache" not in get("/v1/cache/stats", "sk-bob")
