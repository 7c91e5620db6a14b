"""Anthropic's Messages API through the official `anthropic` SDK on the embedded model: replies and
every streamed event validated by the SDK's own types, the same greedy text as OpenAI's chat route
for the same messages, the event sequence, a tool-use round trip (tool_choice any), count_tokens,
stop sequences, errors in Anthropic's shape and the x-api-key header."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

from tests.test_server import serving  # noqa: E402

KEY = "sk-ant-test"
GREEDY = {"temperature": 0.0}  # the current SDK sends sampling fields only as extra_body
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]  # fmt: skip (short calls)


@pytest.fixture(scope="module")
def srv(smollm_path):
    """The embedded SmolLM2 (a real model: its tool calls under a grammar complete quickly)."""
    with serving({}, {"api_key": KEY}) as s:
        yield s


def client(srv, key=KEY):
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0)


def test_a_reply_is_the_openai_routes_text_and_validates(srv):
    from anthropic.types import Message

    c = client(srv)
    msg = c.messages.create(
        model=srv.model, max_tokens=12, extra_body=GREEDY, system="Be brief.",
        messages=[{"role": "user", "content": "hello there"}],
    )  # fmt: skip
    Message.model_validate(msg.model_dump())  # every field as the SDK's type says
    assert msg.role == "assistant" and msg.type == "message" and msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == 12 and [b.type for b in msg.content] == ["text"]
    oai = srv.client(api_key=KEY).chat.completions.create(
        model=srv.model, max_tokens=12, temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
    )  # fmt: skip
    assert msg.content[0].text == oai.choices[0].message.content
    assert msg.usage.input_tokens == oai.usage.prompt_tokens
    count = c.messages.count_tokens(
        model=srv.model, system="Be brief.", messages=[{"role": "user", "content": "hello there"}]
    )
    assert count.input_tokens == oai.usage.prompt_tokens


def test_the_stream_is_anthropics_event_sequence(srv):
    from anthropic.types import RawMessageStreamEvent
    from pydantic import TypeAdapter

    c = client(srv)
    args = dict(
        model=srv.model, max_tokens=10, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}]
    )
    whole = c.messages.create(**args)
    kinds, check = [], TypeAdapter(RawMessageStreamEvent)
    with c.messages.stream(**args) as s:
        for e in s:
            if e.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                          "message_delta", "message_stop"):  # fmt: skip
                check.validate_python(e.model_dump())
                kinds.append(e.type)
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_a_tool_use_round_trip(srv):
    c = client(srv)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    msg = c.messages.create(
        model=srv.model,
        max_tokens=60,
        extra_body=GREEDY,
        messages=ask,
        tools=TOOLS,
        tool_choice={"type": "any"},
    )
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert (
        use.name == "get_weather" and isinstance(use.input, dict) and use.input["city"] in ("Paris", "Rome")
    )
    turn = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
    ]
    again = c.messages.create(model=srv.model, max_tokens=5, extra_body=GREEDY, messages=turn, tools=TOOLS)
    assert again.usage.input_tokens > msg.usage.input_tokens
    assert again.stop_reason in ("max_tokens", "end_turn", "tool_use")
    streamed_calls = []
    with c.messages.stream(model=srv.model, max_tokens=60, extra_body=GREEDY, messages=ask, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:  # fmt: skip
        final = s.get_final_message()
        streamed_calls = [b for b in final.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in streamed_calls] == [(use.name, use.input)]


def test_stop_sequences_and_thinking_switches(srv):
    c = client(srv)
    base = dict(
        model=srv.model, max_tokens=20, extra_body=GREEDY, messages=[{"role": "user", "content": "hi"}]
    )
    text = c.messages.create(**base).content[0].text
    assert len(text) > 4
    cut = c.messages.create(**base, stop_sequences=[text[2:4]])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == text[2:4]
    assert cut.content[0].text == text[:2]
    # a model without a think block: thinking is accepted and changes nothing
    assert c.messages.create(**base, thinking={"type": "disabled"}).content[0].text == text


def test_errors_are_anthropics_shape(srv):
    import httpx

    c = client(srv)
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=srv.model, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in str(e.value)
    with pytest.raises(anthropic.AuthenticationError) as e:
        client(srv, "wrong").messages.create(
            model=srv.model, max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    r = httpx.get(srv.url + "/v1/messages", headers={"x-api-key": KEY})  # the app's own errors too
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["type"] == "error"
    # the x-api-key header is what the SDK sends; a Bearer token works as well
    body = {"model": srv.model, "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(srv.url + "/v1/messages", headers={"Authorization": f"Bearer {KEY}"}, json=body)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 3


def test_thinking_blocks_and_the_budget(tmp_path):
    """A thinking model (its template opens the think block): budget_tokens ends the thinking after that
    many tokens (the end marker forced), the reply's first block is its thinking, streamed as
    thinking_delta events before the text; thinking disabled closes the block in the prompt."""
    from tests.test_structured_outputs import save_thinker

    with serving({"model": save_thinker(str(tmp_path)), "reasoning_parser": "qwen3"}, {}) as s:
        c = client(s, "none")
        args = dict(model=s.model, max_tokens=40, messages=[{"role": "user", "content": "think"}],
                    extra_body={"temperature": 0.0})  # fmt: skip
        msg = c.messages.create(**args, thinking={"type": "enabled", "budget_tokens": 10})
        kinds = [b.type for b in msg.content]
        assert kinds[0] == "thinking" and msg.content[0].thinking and set(kinds) <= {"thinking", "text"}
        with c.messages.stream(**args, thinking={"type": "enabled", "budget_tokens": 10}) as st:
            deltas = [e.delta.type for e in st if e.type == "content_block_delta"]
            final = st.get_final_message()
        assert deltas[0] == "thinking_delta" and final.content[0].thinking == msg.content[0].thinking
        assert all(d == "thinking_delta" for d in deltas[: deltas.count("thinking_delta")])
        off = c.messages.create(**args, thinking={"type": "disabled"})
        assert all(b.type == "text" for b in off.content)
