"""OpenAI's Responses API through the official `openai` SDK on the embedded model: the reply and every
streamed event validated by the SDK's own types and by the Open Responses specification's
(`openresponses-types`: its reasoning events are named apart, `response.reasoning.*`, so those are
checked by the SDK's alone), the same greedy text and prompt tokens as the chat
route, a function-call round trip chained by previous_response_id, structured output, stored
responses (retrieve, input_items, delete) scoped to the API key's tenant, input_tokens."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.test_server import serving

KEYS = (("sk-a", "tenant-a", False), ("sk-b", "tenant-b", False))


def open_responses(obj: dict) -> None:
    """Validate a response, or a streamed event, with the Open Responses types (when installed)."""
    spec = pytest.importorskip("openresponses_types.types")
    if obj.get("object") == "response":
        spec.ResponseResource.model_validate(obj)
        return
    for name in dir(spec):
        if not name.endswith("StreamingEvent"):
            continue
        cls = getattr(spec, name)
        if obj["type"] in {t.value for t in cls.model_fields["type"].annotation}:
            cls.model_validate(obj)
            return


TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
]


@pytest.fixture(scope="module")
def srv(smollm_path):
    with serving({}, {"api_keys": KEYS}) as s:
        yield s


def test_a_response_is_the_chat_routes_text_and_validates(srv):
    c = srv.client(api_key="sk-a")
    r = c.responses.create(
        model=srv.model, input="hello there", instructions="Be brief.", max_output_tokens=12, temperature=0.0
    )
    Response.model_validate(r.model_dump())
    open_responses(r.model_dump(mode="json", exclude_unset=True))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and [it.type for it in r.output] == ["message"]
    chat = c.chat.completions.create(
        model=srv.model,
        max_tokens=12,
        temperature=0.0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}],
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    count = c.responses.input_tokens.count(model=srv.model, input="hello there", instructions="Be brief.")
    assert count.input_tokens == chat.usage.prompt_tokens


def test_the_stream_is_the_typed_event_sequence(srv):
    c = srv.client(api_key="sk-a")
    args = dict(model=srv.model, input="hi", max_output_tokens=10, temperature=0.0)
    whole = c.responses.create(**args)
    check = TypeAdapter(ResponseStreamEvent)
    events = list(c.responses.create(**args, stream=True))
    for e in events:
        check.validate_python(e.model_dump())
        open_responses(e.model_dump(mode="json", exclude_unset=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    # the SDK's stream helper wants a response.completed: a reply that ends on its own
    args["max_output_tokens"] = 300
    with c.responses.stream(**args) as st:
        final = st.get_final_response()
    assert final.status == "completed" and final.output_text == c.responses.create(**args).output_text


def test_a_function_call_round_trip_chained_by_previous_response_id(srv):
    c = srv.client(api_key="sk-a")
    first = c.responses.create(
        model=srv.model,
        input="Weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0.0,
    )
    (call,) = [it for it in first.output if it.type == "function_call"]
    assert call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = c.responses.create(
        model=srv.model,
        input=answer,
        previous_response_id=first.id,
        tools=TOOLS,
        max_output_tokens=5,
        temperature=0.0,
    )
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    # the same conversation spelled out in full gives the same prompt
    full = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *answer,
    ]
    count = c.responses.input_tokens.count(model=srv.model, input=full, tools=TOOLS)
    assert count.input_tokens == second.usage.input_tokens


def test_structured_output(srv):
    c = srv.client(api_key="sk-a")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = c.responses.create(
        model=srv.model,
        input="a number as JSON",
        max_output_tokens=40,
        temperature=0.0,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema}},
    )
    assert isinstance(json.loads(r.output_text)["n"], int)


def test_stored_responses_belong_to_their_tenant(srv):
    a, b = srv.client(api_key="sk-a"), srv.client(api_key="sk-b")
    r = a.responses.create(model=srv.model, input="remember me", max_output_tokens=3, temperature=0.0)
    assert a.responses.retrieve(r.id).output_text == r.output_text
    items = a.responses.input_items.list(r.id)
    assert [it.type for it in items.data] == ["message"] and items.data[0].content[0].text == "remember me"
    for call in (
        lambda: b.responses.retrieve(r.id),
        lambda: b.responses.delete(r.id),
        lambda: b.responses.create(
            model=srv.model, input="x", previous_response_id=r.id, max_output_tokens=2
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = a.responses.create(model=srv.model, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(unstored.id)
    a.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        a.responses.retrieve(r.id)


def test_bad_inputs_are_400s_naming_the_field(srv):
    c = srv.client(api_key="sk-a")
    with pytest.raises(openai.BadRequestError, match="tools"):
        c.responses.create(model=srv.model, input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.responses.create(model=srv.model, input="x", tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="type"):
        c.responses.create(model=srv.model, input=[{"type": "item_reference", "id": "x"}])
    import httpx

    auth = {"Authorization": "Bearer sk-a"}
    r = httpx.get(srv.url + "/v1/responses/x/input_items?limit=many", headers=auth)
    assert r.status_code == 400 and "limit" in r.json()["error"]["message"]


def test_background_responses_are_polled_and_cancelled(srv):
    import time

    c = srv.client(api_key="sk-a")
    r = c.responses.create(model=srv.model, input="hi", max_output_tokens=8, temperature=0.0, background=True)
    assert r.status == "queued" and r.background
    deadline = time.monotonic() + 30
    while (got := c.responses.retrieve(r.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    want = c.responses.create(model=srv.model, input="hi", max_output_tokens=8, temperature=0.0)
    assert got.status == "incomplete" and got.output_text == want.output_text
    long = c.responses.create(model=srv.model, input="a long story", max_output_tokens=2000, background=True,
                              extra_body={"temperature": 1.0})  # fmt: skip
    cancelled = c.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and c.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        srv.client(api_key="sk-b").responses.cancel(long.id)  # another tenant's
    with pytest.raises(openai.BadRequestError, match="background"):
        c.responses.cancel(want.id)  # not a background response
    deadline = time.monotonic() + 10
    while srv.engine.kv.num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.engine.kv.num_used_blocks == 0
