"""Hostile constraints (issue 34): what an outside probe sent through the constraint layer, which any
tenant's key can drive, against a real server on the embedded model. Each numbered item of the issue:

1. a Lark chain of 3,000 rules segfaulted the process (the compiler overflowed its thread's stack);
2. a closing plan for `minLength: 301` froze every other stream for 6.6 s;
3. grammars over llguidance's parser or lexer limits compiled, then failed at their first token as a
   500, and stayed cached;
4. the grammar cache was bounded by entries, not bytes (300 KB choice lists held ~31 MiB each);
5. tool turns OpenAI refuses were accepted, and error messages named internals;
6. no server default for max_tokens.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from tests.test_adversarial import stream_gaps
from tests.test_server import serving
from tests.test_structured import RUNTIME_ROW

pytest.importorskip("llguidance")

STREAM = {
    "messages": [{"role": "user", "content": "Count slowly."}],
    "max_tokens": 80,
    "ignore_eos": True,
    "stream": True,
    "temperature": 0,
}


def chain(n: int) -> str:
    """start: r0; r{i}: "t" r{i+1} | "u"; r{n}: "end" — rules the compiler recurses through."""
    return "start: r0\n" + "".join(f'r{i}: "t" r{i + 1} | "u"\n' for i in range(n)) + f'r{n}: "end"\n'


ANY_OF_2000 = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(2000)
    ]
}

# (what, the constraint fields of a /v1/completions body): each over a published limit
OVER_LIMIT = [
    ("2,001 choices", {"guided_choice": [f"c{i}" for i in range(2001)]}),
    ("5,000 Lark alternatives", {"guided_grammar": "start: " + " | ".join(f'"w{i}"' for i in range(5000))}),
    ("anyOf of 2,000 objects", {"guided_json": ANY_OF_2000}),
    ("a{1000000}", {"guided_regex": "a{1000000}"}),
    ("((a{100}){100}){100}", {"guided_regex": "((a{100}){100}){100}"}),
    ("pattern ^a{50000}$", {"guided_json": {"type": "string", "pattern": "^a{50000}$"}}),
    ("30,000 chained rules", {"guided_grammar": chain(30_000)}),
]


def completion(extra: dict, max_tokens: int = 4) -> dict:
    return {"prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0, **extra}


@pytest.fixture(scope="module")
def real(smollm_path):
    # the weights `foveal serve` runs (packed Q4_1): a bystander's step is then ~40 ms, not the dense fp32
    # model's 110-270 ms on the Zen 3 host, and a 0.5 s gap is a stall, not two slow steps
    with serving({"quantization": "auto"}, {}) as s:
        yield s


def post(s, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=timeout)


def test_the_grammar_backend_is_built_before_the_server_serves(real):
    """Built at the first constrained request, llguidance's reading of the vocabulary held the GIL for
    ~0.85 s on the 2-vCPU Zen 3 host: every stream stopped. The module's first test: nothing has been
    constrained yet, and the backend is there (its tables for closing plans too)."""
    stats = real.processor.grammar_stats()
    assert stats is not None and stats.misses == 0, stats
    backend = real.processor.grammars.backend
    assert backend._byte_tokens is not None and backend._lead_bytes is not None


# -- 1 and 3: over a limit is a quick 400, every time; a deep chain within them compiles -----------------
@pytest.mark.alone
@pytest.mark.parametrize("what,extra", OVER_LIMIT, ids=[w for w, _ in OVER_LIMIT])
def test_an_over_limit_grammar_is_a_400_at_once_and_on_retry(real, what, extra):
    for attempt in range(2):  # the second is not served from any cache: refused the same way
        t = time.perf_counter()
        r = post(real, "/v1/completions", completion(extra))
        took = time.perf_counter() - t
        assert r.status_code == 400, (what, attempt, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "limit" in err["message"], err
        assert took < 1.0, f"{what}: refused after {took:.2f} s"
    assert post(real, "/v1/completions", completion({})).status_code == 200  # and the server serves on


def test_a_chain_of_3000_rules_compiles_and_the_server_stays_up(real):
    """3,000 chained rules killed the process (an 8 MiB stack); compiled on the 256 MiB compile thread
    they serve, and a 10,000-rule chain (the limit) does too."""
    for n in (3_000, 9_998):
        r = post(real, "/v1/completions", completion({"guided_grammar": chain(n)}, max_tokens=6))
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["text"][:1] in ("t", "u", "e"), r.json()["choices"][0]
    assert post(real, "/v1/completions", completion({})).status_code == 200


# -- 2, 1, 3, 4: a bystander stream keeps getting tokens while the hostile requests run ----------------
def big_choice(seed: int, size: int = 300_000, n: int = 900) -> list[str]:
    """n distinct strings adding up to ~size bytes (the probe's 300 KB lists, under the 1,998 limit)."""
    return [f"{seed}-{j}-" + "x" * (size // n - 12) for j in range(n)]


HOSTILE = [
    ("chain of 3,000 rules", completion({"guided_grammar": chain(3000)})),
    *((w, completion(e)) for w, e in OVER_LIMIT),
    *(
        (f"minLength {n}", completion({"guided_json": {"type": "string", "minLength": n}}, max_tokens=8))
        for n in (301, 20_000, 100_000)
    ),
    *((f"300 KB choice {i}", completion({"guided_choice": big_choice(i)}, max_tokens=2)) for i in range(5)),
]


@pytest.mark.alone
def test_hostile_constraints_do_not_stall_a_stream(real):
    """While one stream decodes, each hostile request of items 1-4 is sent in turn: the stream never
    waits 0.5 s for a token (a closing plan for minLength 301 froze it for 6.6 s; a 3,000-rule chain
    killed it)."""

    async def main():
        gaps: list[float] = []
        codes, spans = {}, []
        async with httpx.AsyncClient(base_url=real.url, timeout=120) as c:
            task = asyncio.create_task(stream_gaps(c, STREAM, gaps))
            while len(gaps) < 3:
                await asyncio.sleep(0.01)
            start = len(gaps)
            for what, body in HOSTILE:
                codes[what] = (await c.post("/v1/completions", json=body)).status_code
                spans.append((what, len(gaps)))  # the gaps seen by the end of each request
            end = len(gaps)
            await task
        return gaps, start, end, codes, spans

    gaps, start, end, codes, spans = asyncio.run(main())
    assert end < len(gaps), f"the stream ended before the hostile requests were done ({len(gaps)} gaps)"
    assert all(codes[w] == 400 for w, _ in OVER_LIMIT), codes
    assert all(code in (200, 400) for code in codes.values()), codes
    during = gaps[start : end + 1]
    worst = start + max(range(len(during)), key=during.__getitem__)
    culprit = next((w for w, n in spans if n > worst), "after the last")  # in flight when it ended
    assert max(during) < 0.5, f"a {max(during):.2f} s gap between tokens, ending during {culprit!r}"


def test_a_closing_plan_over_its_budget_is_given_up(real):
    """minLength 301 under max_tokens 8: no plan fits, and the search for one stops at its budget
    (closing.Budget) instead of running for seconds; the request ends as it would have, cut."""
    from foveal.structured import closing

    before = closing.BUDGET.skipped
    body = completion({"guided_json": {"type": "string", "minLength": 301, "maxLength": 400}}, max_tokens=8)
    r = post(real, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text[:300]
    assert closing.BUDGET.skipped > before


# -- 3: a grammar that fails when it runs is the request's 400, and refused from then on ---------------
def test_a_grammar_failing_at_run_time_is_a_400_and_refused_after(real):
    """Over llguidance's parser row only at its second token (the compile's one-step probe passes): the
    request fails with a 400 (not a 500), the grammar leaves the cache and a retry is refused at
    once. A low row limit stands in for a grammar that big."""
    from llguidance import LLParserLimits

    from foveal.structured import GrammarCache
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    proc = real.processor
    saved = proc._grammars
    backend = LLGuidanceBackend.from_tokenizer(
        proc.tokenizer, vocab_size=proc.mask_vocab, eos_token_ids=proc.info.eos_token_ids,
        limits=LLParserLimits(max_items_in_row=40, verbose_errors=False),
    )  # fmt: skip
    proc._grammars = GrammarCache(backend)
    try:
        grammar = {"guided_grammar": RUNTIME_ROW}
        r = post(real, "/v1/completions", completion(grammar, max_tokens=6))
        assert r.status_code == 400, r.text[:300]
        assert r.json()["error"]["type"] == "invalid_request_error", r.json()
        assert "items; max is 40" in r.json()["error"]["message"]
        r = post(real, "/v1/completions", completion(grammar, max_tokens=6))
        assert r.status_code == 400 and "exceeded a limit when it ran" in r.json()["error"]["message"], r.text
        assert proc.grammars.stats().refused == 1 and len(proc.grammars) == 0
    finally:
        proc._grammars = saved


# -- 4: the grammar cache is bounded in bytes ---------------------------------------------------------
def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_150_distinct_300kb_grammars_stay_within_the_cache_bound(smollm_path):
    """150 distinct 300 KB choice lists (900 strings each), one request each: the cache keeps what fits
    its byte bound (here 64 MiB of estimates), and the process grows by less than that bound plus
    64 MiB (docs/structured-outputs.md). Held by entries only (256, as before), they kept ~2.5 MiB
    each: ~375 MiB for these 150, three times what the bound allows (300 took 49 s of the suite)."""
    bound = 64 * 2**20
    with serving({"grammar_cache_bytes": bound}, {}) as s:
        post(s, "/v1/completions", completion({"guided_choice": big_choice(-1)}, max_tokens=1))  # warm up
        before = rss()
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for i in range(150):
                r = c.post("/v1/completions", json=completion({"guided_choice": big_choice(i)}, max_tokens=1))
                assert r.status_code == 200, r.text[:200]
        grew = rss() - before
        st = s.processor.grammars.stats()
        assert st.nbytes <= bound and st.entries < 20, st
        assert grew < bound + 64 * 2**20, f"grew {grew / 2**20:.0f} MiB"
        metrics = httpx.get(s.url + "/metrics").text
        assert "foveal_grammar_cache_bytes" in metrics


# -- 5: tool turns, duplicate names, and error messages in the API's words ----------------------------
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,tools,param",
    [
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "sunny"}], [TOOL],
         "messages.1.tool_call_id"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
          {"role": "tool", "content": "sunny", "tool_call_id": "call_9"}], [TOOL], "messages.2.tool_call_id"),
        ([{"role": "user", "content": "hi"}], [TOOL, TOOL], "tools.1.function.name"),
    ],
    ids=["tool message without its id", "tool message answering no call", "two tools of one name"],
)  # fmt: skip
def test_tool_turns_openai_refuses_are_400s(real, messages, tools, param):
    r = post(real, "/v1/chat/completions", {"messages": messages, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALL]},
          {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]  # fmt: skip
    assert (
        post(real, "/v1/chat/completions", {"messages": ok, "tools": [TOOL], "max_tokens": 2}).status_code
        == 200
    )


def test_error_messages_name_no_internals(real):
    user = [{"role": "user", "content": "hi"}]
    cycle = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    r = post(real, "/v1/completions", completion({"guided_json": cycle}))
    assert r.status_code == 400 and "$ref cycle" in r.json()["error"]["message"], r.text[:300]
    assert "NoExtensionBias" not in r.text
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    r = post(real, "/v1/chat/completions", {"messages": user, "tools": [bad_tool], "tool_choice": "required"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tools.0.function.parameters", r.text[:300]
    assert "nope" in err["message"] and "%llguidance" not in err["message"] and "start:" not in err["message"]
    r = post(real, "/v1/chat/completions", {"messages": user, "tools": [TOOL], "tool_choice": {"type": "x"}})
    assert r.status_code == 400 and "NamedToolChoice" not in r.text, r.text[:300]


def test_openapi_describes_what_the_server_takes(real):
    doc = httpx.get(real.url + "/openapi.json").json()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert "requestBody" in doc["paths"][path]["post"], path
    message = doc["components"]["schemas"]["ChatMessage"]
    assert any("required" in arm and arm["required"] == ["content"] for arm in message["anyOf"])


# -- 6: a server default (and cap) for max_tokens -----------------------------------------------------
def test_the_server_has_a_default_and_a_cap_for_max_tokens(smollm_path):
    with serving({}, {"max_tokens": 5}) as s:
        chat = {"messages": [{"role": "user", "content": "Write a long story."}], "ignore_eos": True}
        for extra in ({}, {"max_tokens": 50}):
            r = post(s, "/v1/chat/completions", {**chat, **extra})
            assert r.status_code == 200, r.text[:200]
            assert r.json()["usage"]["completion_tokens"] == 5, (extra, r.json()["usage"])
            assert r.json()["choices"][0]["finish_reason"] == "length"
        r = post(s, "/v1/chat/completions", {**chat, "max_tokens": 3})
        assert r.json()["usage"]["completion_tokens"] == 3
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["max_tokens"] == 5


def test_the_default_max_tokens_leaves_room_for_a_long_prompt(real):
    """The server's default (4,096 here) is cut to what the context leaves; it does not refuse a prompt
    that leaves fewer (an explicit max_tokens that does not fit is refused, as before)."""
    from foveal import SamplingParams

    proc = real.processor
    room = 100
    ids = [1] * (proc.info.max_request_tokens - room)
    req = proc.request(ids, SamplingParams(max_tokens=None, default_max_tokens=4096))
    assert req.params.max_tokens == room
    assert (
        proc.request([1] * 10, SamplingParams(max_tokens=None, default_max_tokens=64)).params.max_tokens == 64
    )
    with pytest.raises(ValueError, match="exceeds"):
        proc.request(ids, SamplingParams(max_tokens=room + 1))


def test_text_the_vocabulary_cannot_write_is_a_400(real):
    """Found by the fuzz run (benchmarks/fuzz_grammars.py): a choice with a character whose UTF-8 lead
    byte no token has was a 500 (llguidance's mask offered the next byte, which its matcher refused)."""
    char = "\U000802bc"
    r = post(real, "/v1/completions", completion({"guided_choice": ["x", f"e{char}w"]}))
    assert r.status_code == 400 and "choice 1" in r.json()["error"]["message"], r.text[:300]
    r = post(real, "/v1/completions", completion({"guided_grammar": f'start: "e{char}w"'}, max_tokens=4))
    assert r.status_code == 400 and "byte 0xf2" in r.json()["error"]["message"], r.text[:300]
    assert r.json()["error"]["type"] == "invalid_request_error"
