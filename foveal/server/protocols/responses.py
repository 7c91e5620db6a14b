"""OpenAI's Responses API over the same chat core as chat completions: the request becomes a ChatInput
(server/chat_input.py), the choice's output events (parsing/output.py) become output items.

    POST   /v1/responses                    create: whole, or streamed as typed events (sequence_number)
    GET    /v1/responses/{id}               a stored response
    DELETE /v1/responses/{id}               forget it
    GET    /v1/responses/{id}/input_items   the items it was given (newest last; `order` asc/desc)
    POST   /v1/responses/input_tokens       the prompt's token count, nothing generated
    POST   /v1/responses/{id}/cancel        stop a background response (`background: true` returns at
                                            once, status queued; GET polls it until it is done)

    input                str, or items: messages (input_text, input_image, output_text parts),
                         function_call and function_call_output, reasoning (text kept as the turn's)
    instructions         a system message first (not carried over to a chained response, as OpenAI)
    previous_response_id the stored conversation (its input and output) comes before `input`
    tools, tool_choice   function tools; auto / none / required / {"type": "function", "name"}
    reasoning.effort     the template's reasoning_effort; the reasoning comes back as reasoning items
    text.format          json_schema or json_object constrain the answer (structured outputs)
    output items         reasoning, message (output_text), function_call, in the order they began

Stored responses (`store`, default true) live in memory, per tenant (API key): another tenant's id is a
404, as an unknown one. At most `ResponseStore.max_count` responses and `max_bytes` of their JSON are
kept (least recently used dropped first); a restart keeps none, by design (no file, no database).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from foveal.engine.loop import StreamFailed
from foveal.parsing.output import ChoiceOutput
from foveal.parsing.tools import ContentDelta, ReasoningDelta, ToolCallDelta
from foveal.request import FinishReason, SamplingParams, new_request_id
from foveal.server.body import read_model
from foveal.server.chat_input import ChatInput
from foveal.server.errors import APIError, from_stream_error
from foveal.structured.constraint import OutputConstraint

log = logging.getLogger(__name__)


class ResponseStore:
    """Stored responses per (tenant, id), least recently used first out past max_count or max_bytes."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 64 * 2**20):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._items: OrderedDict[tuple[str | None, str], tuple[dict, int]] = OrderedDict()
        self.nbytes = 0

    def put(self, tenant: str | None, rid: str, entry: dict) -> None:
        size = len(json.dumps(entry, separators=(",", ":")))
        self.delete(tenant, rid)
        self._items[(tenant, rid)] = (entry, size)
        self.nbytes += size
        while self._items and (len(self._items) > self.max_count or self.nbytes > self.max_bytes):
            _, (_, n) = self._items.popitem(last=False)
            self.nbytes -= n

    def get(self, tenant: str | None, rid: str) -> dict | None:
        hit = self._items.get((tenant, rid))
        if hit is None:
            return None
        self._items.move_to_end((tenant, rid))
        return hit[0]

    def delete(self, tenant: str | None, rid: str) -> bool:
        hit = self._items.pop((tenant, rid), None)
        if hit is not None:
            self.nbytes -= hit[1]
        return hit is not None


class _Format(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class _Text(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: _Format | None = None
    verbosity: str | None = None


class _Reasoning(BaseModel):
    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: str | None = None
    generate_summary: str | None = None


class InputTokensRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    truncation: Literal["auto", "disabled"] | None = None


class CreateRequest(InputTokensRequest):
    stream: bool = False
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    # accepted and not used here: hints for OpenAI's own caching, safety and accounting
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None
    background: bool | None = None


def _refuse(param: str, why: str):
    raise APIError(400, f"{param}: {why}", param=param)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    kinds = ("input_text", "output_text", "text")
    return "".join(p.get("text", "") for p in content if p.get("type") in kinds)


def input_messages(items: list[dict], multimodal: bool) -> tuple[list[dict], list[tuple[int, str]]]:
    """Template messages (and image refs) of input items; function calls join the assistant turn
    before them, reasoning the next assistant turn."""
    messages: list[dict] = []
    images: list[tuple[int, str]] = []
    thought = None
    for n, it in enumerate(items):
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                _refuse(f"input[{n}].role", f"{role!r} is not a message role")
            content = it.get("content", "")
            if isinstance(content, list) and any(p.get("type") == "input_image" for p in content):
                if role != "user":
                    _refuse(f"input[{n}]", "images are only allowed in user messages")
                parts = []
                for p in content:
                    if p.get("type") == "input_image":
                        if not isinstance(p.get("image_url"), str):
                            _refuse(f"input[{n}]", "an input_image needs an image_url (no file ids here)")
                        images.append((len(messages), p["image_url"]))
                        parts.append({"type": "image"})
                    else:
                        parts.append({"type": "text", "text": p.get("text", "")})
                msg: dict = {"role": "user", "content": parts if multimodal else _text_of(content)}
            else:
                msg = {"role": "system" if role == "developer" else role, "content": _text_of(content)}
            if role == "assistant" and thought:
                msg["reasoning_content"], thought = thought, None
            messages.append(msg)
        elif kind == "function_call":
            call = {
                "id": it.get("call_id"),
                "type": "function",
                "function": {"name": it.get("name"), "arguments": _json_args(it.get("arguments"), n)},
            }
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("content"):
                last = {"role": "assistant", "content": ""}
                if thought:
                    last["reasoning_content"], thought = thought, None
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = it.get("output", "")
            messages.append({"role": "tool", "tool_call_id": it.get("call_id"), "content": _text_of(out)})
        elif kind == "reasoning":
            thought = "".join(c.get("text", "") for c in it.get("content") or []) or None
        else:
            _refuse(f"input[{n}].type", f"{kind!r} items are not supported")
    return messages, images


def _as_stored(item: dict) -> dict:
    """An input item as input_items lists it: a message's text content as one text part."""
    if item.get("type", "message") != "message" or not isinstance(item.get("content"), str):
        return item
    kind = "output_text" if item.get("role") == "assistant" else "input_text"
    return {**item, "type": "message", "content": [{"type": kind, "text": item["content"]}]}


def _json_args(text, n: int) -> dict:
    try:
        args = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        _refuse(f"input[{n}].arguments", "not JSON")
    if not isinstance(args, dict):
        _refuse(f"input[{n}].arguments", "must be a JSON object")
    return args


def _tools(req: InputTokensRequest) -> tuple[list[dict] | None, str | dict]:
    tools = None
    if req.tools:
        tools = []
        for i, t in enumerate(req.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                _refuse(f"tools[{i}]", "only function tools ({type: function, name, parameters}) are served")
            fn = {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            }
            tools.append({"type": "function", "function": fn})
    tc = req.tool_choice
    if not tools:
        if tc not in (None, "none", "auto"):
            _refuse("tool_choice", "tool_choice needs tools")
        return None, "none"
    if tc is None or tc in ("auto", "none", "required"):
        return tools, tc or "auto"
    if isinstance(tc, dict) and tc.get("type") == "function" and isinstance(tc.get("name"), str):
        return tools, {"type": "function", "function": {"name": tc["name"]}}
    _refuse("tool_choice", "auto, none, required or {type: function, name}")


def _usage(final) -> dict:
    return {
        "input_tokens": final.num_prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
        "output_tokens": final.num_output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.num_prompt_tokens + final.num_output_tokens,
    }


class _Items:
    """The output items an output's events build, in the order they begin; `feed` answers the stream
    events they make (as (type, body) pairs), `close` those of the item still open."""

    def __init__(self, rid: str):
        self.rid, self.items, self.open = rid, [], None

    def feed(self, e) -> list[tuple[str, dict]]:
        out = []
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                out += self.close()
                item = {
                    "type": "function_call",
                    "id": f"fc_{e.id[5:]}",
                    "call_id": e.id,
                    "name": e.name,
                    "arguments": "",
                    "status": "in_progress",
                }
                out += self._add(item)
            item = self.items[-1]
            if e.arguments:
                item["arguments"] += e.arguments
                out.append(
                    (
                        "response.function_call_arguments.delta",
                        {"item_id": item["id"], "output_index": len(self.items) - 1, "delta": e.arguments},
                    )
                )
            return out
        kind = "reasoning" if isinstance(e, ReasoningDelta) else "message"
        if self.open is None or self.items[-1]["type"] != kind:
            out += self.close()
            n = len(self.items)
            if kind == "reasoning":
                part = {"type": "reasoning_text", "text": ""}
                item = {
                    "type": "reasoning",
                    "id": f"rs_{self.rid}_{n}",
                    "summary": [],
                    "content": [part],
                    "status": "in_progress",
                }
            else:
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                item = {
                    "type": "message",
                    "id": f"msg_{self.rid}_{n}",
                    "role": "assistant",
                    "content": [part],
                    "status": "in_progress",
                }
            out += self._add(item)
            added = {"item_id": item["id"], "output_index": n, "content_index": 0, "part": dict(part)}
            out.append(("response.content_part.added", added))
        item = self.items[-1]
        item["content"][0]["text"] += e.text
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            out.append(("response.reasoning_text.delta", {**where, "delta": e.text}))
        else:
            out.append(("response.output_text.delta", {**where, "delta": e.text, "logprobs": []}))
        return out

    def _add(self, item: dict) -> list[tuple[str, dict]]:
        self.items.append(item)
        self.open = item
        return [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})]

    def close(self, complete: set[str] | None = None) -> list[tuple[str, dict]]:
        """The open item's closing events. `complete`: the ids of the calls that closed (a call the
        output cut short stays "incomplete")."""
        item, self.open = self.open, None
        if item is None:
            return []
        n = len(self.items) - 1
        out = []
        cut = item["type"] == "function_call" and complete is not None and item["call_id"] not in complete
        item["status"] = "incomplete" if cut else "completed"
        if item["type"] == "function_call":
            out.append(
                (
                    "response.function_call_arguments.done",
                    {
                        "item_id": item["id"],
                        "output_index": n,
                        "arguments": item["arguments"],
                        "name": item["name"],
                    },
                )
            )
        else:
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": n, "content_index": 0}
            if item["type"] == "reasoning":
                out.append(("response.reasoning_text.done", {**where, "text": part["text"]}))
            else:
                out.append(("response.output_text.done", {**where, "text": part["text"], "logprobs": []}))
            out.append(("response.content_part.done", {**where, "part": dict(part)}))
        if item["type"] == "reasoning":
            del item["status"]  # a reasoning item's status is optional; the SDK's type has none to check
        out.append(("response.output_item.done", {"output_index": n, "item": json.loads(json.dumps(item))}))
        return out


def router(loop, processor, cfg, names: set[str], model_name: str, prompts, store: ResponseStore):
    r = APIRouter()
    running: dict[tuple[str | None, str], asyncio.Task] = {}  # background responses still generating

    def chat_input(req: InputTokensRequest, tenant) -> tuple[ChatInput, list[dict], list[dict]]:
        """(the neutral request, the conversation before this input, this input's items)."""
        history: list[dict] = []
        if req.previous_response_id:
            prev = store.get(tenant, req.previous_response_id)
            if prev is None:
                raise APIError(
                    404,
                    f"previous response '{req.previous_response_id}' was not found",
                    param="previous_response_id",
                )
            history = prev["conversation"]
        items = req.input or []
        if isinstance(items, str):
            items = [{"type": "message", "role": "user", "content": items}]
        items = [_as_stored(it) for it in items]
        multimodal = processor.info.is_multimodal
        msgs, images = input_messages(items, multimodal)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        offset = len(system) + len(history)
        tools, mode = _tools(req)
        effort = req.reasoning.effort if req.reasoning is not None else None
        fmt = req.text.format if req.text is not None else None
        chat = ChatInput(
            messages=system + history + msgs,
            images=[(i + offset, url) for i, url in images],
            tools=tools,
            tool_mode=mode,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            reasoning_effort={"xhigh": "high"}.get(effort, effort),
            grammar_source="text.format" if fmt is not None and fmt.type != "text" else None,
        )
        return chat, history + msgs, items

    def constraint(req: InputTokensRequest) -> OutputConstraint | None:
        fmt = req.text.format if req.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return OutputConstraint.json_schema({"type": "object"})
        if fmt.schema_ is None:
            _refuse("text.format.schema", "a json_schema format needs its schema")
        return OutputConstraint.json_schema(fmt.schema_)

    def salt(request: Request) -> str | None:
        t = request.state.tenant
        return None if t is None else f"{t}\x00"

    async def create(request: Request):
        req = await read_model(request, CreateRequest, cfg.max_body_bytes, cfg.body_timeout)
        if req.model is not None and req.model not in names:
            raise APIError(
                404,
                f"model '{req.model}' does not exist; this server serves '{model_name}'",
                param="model",
                code="model_not_found",
            )
        if req.background and (not req.store or req.stream):
            _refuse("background", "a background response needs store true and no stream (poll it with GET)")
        tenant = request.state.tenant
        chat, conversation, items = chat_input(req, tenant)
        cap, wanted = cfg.max_tokens, req.max_output_tokens  # the server's default and cap, if any
        try:
            params = SamplingParams(
                max_tokens=wanted if not cap or wanted is None else min(wanted, cap),
                default_max_tokens=cap,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                structured=constraint(req),
            )
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        rid = new_request_id("resp")
        request.state.request_id = rid
        choices, plan = await prompts.chat(chat, params, rid, salt(request))
        stream = loop.submit(rid, choices, streaming=req.stream, timeout=cfg.request_timeout, tenant=tenant)
        try:
            await stream.admitted()
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        base = {
            "id": rid,
            "object": "response",
            "created_at": int(time.time()),
            "model": req.model or model_name,
            "status": "in_progress",
            "output": [],
            "instructions": req.instructions,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "top_logprobs": 0,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "metadata": req.metadata or {},
            "store": req.store,
            "background": bool(req.background),
            "service_tier": "default",
            "safety_identifier": req.safety_identifier,
            "prompt_cache_key": req.prompt_cache_key,
            "completed_at": None,
            "text": {"format": {"type": "text"}}
            if req.text is None or req.text.format is None
            else {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)},
            "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning else None,
            "truncation": "disabled",
            "usage": None,
            "error": None,
            "incomplete_details": None,
        }
        run = _Run(stream, ChoiceOutput(plan), _Items(rid), base)

        def finish(response: dict) -> None:
            if req.store:
                store.put(
                    tenant,
                    rid,
                    {
                        "response": response,
                        "input_items": items,
                        "conversation": conversation + [_assistant_turn(response)],
                    },
                )

        if req.background:  # runs on; GET polls it, cancel stops it
            queued = {**base, "status": "queued", "background": True}
            store.put(tenant, rid, {"response": queued, "input_items": items, "conversation": conversation})
            running[(tenant, rid)] = asyncio.create_task(background(run, tenant, rid, finish, queued))
            return JSONResponse(queued)
        if req.stream:
            return StreamingResponse(
                run.events(finish, loop),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            response = await run.whole(loop)
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        finish(response)
        return JSONResponse(response)

    async def background(run: _Run, tenant, rid: str, finish, queued: dict) -> None:
        try:
            response = await run.whole(loop)
        except asyncio.CancelledError:
            return
        except (StreamFailed, APIError) as e:
            why = e.error.message if isinstance(e, StreamFailed) else e.message
            response = {**queued, "status": "failed", "error": {"code": "server_error", "message": why}}
        finally:
            running.pop((tenant, rid), None)
        if store.get(tenant, rid) is not None:  # not deleted meanwhile
            finish({**response, "background": True})

    async def cancel(request: Request, response_id: str):
        tenant = request.state.tenant
        hit = store.get(tenant, response_id)
        if hit is None:
            raise APIError(404, f"response '{response_id}' was not found", code="not_found")
        task = running.pop((tenant, response_id), None)
        if task is None:
            if not hit["response"].get("background"):
                raise APIError(400, "only a background response can be cancelled")
            return JSONResponse(hit["response"])  # finished already: as it is
        loop.abort(response_id)
        task.cancel()
        cancelled = {**hit["response"], "status": "cancelled"}
        store.put(tenant, response_id, {**hit, "response": cancelled})
        return JSONResponse(cancelled)

    async def retrieve(request: Request, response_id: str):
        hit = store.get(request.state.tenant, response_id)
        if hit is None:
            raise APIError(404, f"response '{response_id}' was not found", code="not_found")
        return JSONResponse(hit["response"])

    async def delete(request: Request, response_id: str):
        task = running.pop((request.state.tenant, response_id), None)
        if task is not None:  # a background response still generating stops
            loop.abort(response_id)
            task.cancel()
        if not store.delete(request.state.tenant, response_id):
            raise APIError(404, f"response '{response_id}' was not found", code="not_found")
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(request: Request, response_id: str, order: str = "desc", limit: int = 20):
        hit = store.get(request.state.tenant, response_id)
        if hit is None:
            raise APIError(404, f"response '{response_id}' was not found", code="not_found")
        items = [{"id": f"in_{response_id}_{i}", **it} for i, it in enumerate(hit["input_items"])]
        if order == "desc":
            items.reverse()
        items = items[: max(1, min(limit, 100))]
        return JSONResponse(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None,
                "has_more": False,
            }
        )

    async def input_tokens(request: Request):
        req = await read_model(request, InputTokensRequest, cfg.max_body_bytes, cfg.body_timeout)
        chat, _, _ = chat_input(req, request.state.tenant)
        choices, _ = await prompts.chat(chat, SamplingParams(max_tokens=1), new_request_id("count"), None)
        count = len(choices[0].prompt_token_ids)
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    r.add_api_route("/v1/responses", create, methods=["POST"])
    r.add_api_route("/v1/responses/input_tokens", input_tokens, methods=["POST"])
    r.add_api_route("/v1/responses/{response_id}", retrieve, methods=["GET"])
    r.add_api_route("/v1/responses/{response_id}", delete, methods=["DELETE"])
    r.add_api_route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"])
    r.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])
    return r


def _assistant_turn(response: dict) -> dict:
    """A finished response's output as the template's assistant message (for a chained response)."""
    msg: dict = {"role": "assistant", "content": ""}
    for it in response["output"]:
        if it["type"] == "message":
            msg["content"] += it["content"][0]["text"]
        elif it["type"] == "reasoning":
            msg["reasoning_content"] = msg.get("reasoning_content", "") + it["content"][0]["text"]
        elif it["type"] == "function_call" and it["status"] == "completed":
            call = {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": json.loads(it["arguments"])},
            }
            msg.setdefault("tool_calls", []).append(call)
    return msg


class _Run:
    """One response's generation: whole, or as the typed event stream."""

    def __init__(self, stream, out: ChoiceOutput, items: _Items, base: dict):
        self.stream, self.out, self.items, self.base = stream, out, items, base
        self.seq = 0

    def _done(self, final) -> dict:
        cut = final.finish_reason is FinishReason.LENGTH
        resp = {
            **self.base,
            "output": self.items.items,
            "usage": _usage(final),
            "status": "incomplete" if cut else "completed",
            "completed_at": int(time.time()),
        }
        if cut:
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        return resp

    def _feed(self, d) -> list[tuple[str, dict]]:
        events = self.out.feed(d.text)
        if d.finished:
            events += self.out.finish(truncated=d.finish_reason is FinishReason.LENGTH)
        out = []
        for e in events:
            if isinstance(e, ContentDelta | ReasoningDelta | ToolCallDelta):
                out += self.items.feed(e)
        if d.finished:
            out += self.items.close({c.id for c in self.out.calls})
        return out

    async def whole(self, loop) -> dict:
        final = None
        try:
            async for _, d in self.stream.deltas():
                self._feed(d)
                if d.finished:
                    final = d
        finally:
            if not self.stream.finished:
                loop.abort(self.stream.request_id)
        if final.error:
            raise APIError(400 if final.error_type == "invalid_request_error" else 500, final.error)
        return self._done(final)

    def _event(self, kind: str, body: dict) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **body}, separators=(",", ":"))
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    async def events(self, finish, loop):
        yield self._event("response.created", {"response": self.base})
        yield self._event("response.in_progress", {"response": self.base})
        try:
            async for _, d in self.stream.deltas():
                for kind, body in self._feed(d):
                    yield self._event(kind, body)
                if d.finished:
                    if d.error:
                        error = {"code": "server_error", "message": d.error}
                        failed = {**self.base, "status": "failed", "error": error}
                        yield self._event("response.failed", {"response": failed})
                        return
                    response = self._done(d)
                    finish(response)
                    cut = response["status"] == "incomplete"
                    kind = "response.incomplete" if cut else "response.completed"
                    yield self._event(kind, {"response": response})
        except StreamFailed as e:
            err = from_stream_error(e.error)
            yield self._event("error", {"code": err.code or err.type, "message": err.message, "param": None})
        finally:
            if not self.stream.finished:
                loop.abort(self.stream.request_id)
