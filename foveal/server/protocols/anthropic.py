"""Anthropic's Messages API: `POST /v1/messages` (whole, or streamed as Anthropic's event sequence) and
`POST /v1/messages/count_tokens`, over the same chat core as OpenAI's chat completions: the request
becomes a ChatInput (server/chat_input.py) and SamplingParams, the choice's output events
(parsing/output.py) become content blocks.

    system, messages          -> template messages: text and image blocks (base64 or URL) as parts,
                                 tool_use as the assistant's tool_calls, thinking as its reasoning,
                                 tool_result as tool messages (before the rest of the user's turn)
    tools, tool_choice        -> function tools; auto / any (required) / tool (named) / none;
                                 disable_parallel_tool_use
    thinking                  -> enabled: enable_thinking and budget_tokens as the thinking budget;
                                 disabled: enable_thinking false
    max_tokens, stop_sequences, temperature, top_p, top_k, metadata (accepted, unused)
    reply                     -> content blocks thinking / text / tool_use; stop_reason end_turn,
                                 max_tokens, stop_sequence (with stop_sequence) or tool_use; usage

Streamed: message_start, ping, then per block content_block_start / _delta (thinking_delta,
text_delta, input_json_delta) / _stop, then message_delta (stop_reason, usage) and message_stop.
Errors in Anthropic's shape ({"type": "error", "error": {"type", "message"}}); the API key may come as
`x-api-key` (the auth middleware takes it as well as a Bearer token).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

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
from foveal.server.protocols.whole import events_of, run_whole
from foveal.structured.constraint import OutputConstraint

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "api_error"}  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Block(BaseModel):
    """A content block: a client sends back the blocks a reply gave it, with the reply-only fields the
    SDK's types carry (caller, citations, ...): those are ignored, not refused."""

    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ImageSource(_Strict):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def as_url(self) -> str:
        if self.type == "url":
            if not self.url:
                raise APIError(400, "an image source of type url needs a url", param="messages")
            return self.url
        if not self.data or not self.media_type:
            raise APIError(400, "a base64 image source needs media_type and data", param="messages")
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource
    cache_control: dict | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict | None = None


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Block):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Strict):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom"
    cache_control: dict | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    # enabled (with a budget), adaptive and between_tools (the model decides: no budget), disabled
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(default=None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    # the sampling fields older clients send (the current SDK passes them only as extra_body)
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    output_config: OutputConfig | None = None  # effort (the template's reasoning_effort), a JSON schema
    # accepted and not used here: where to run, caching and accounting hints of Anthropic's service
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    cache_control: dict | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None


def chat_input(req: CountTokensRequest, multimodal: bool) -> ChatInput:
    """The neutral chat request of an Anthropic one."""
    messages: list[dict] = []
    images: list[tuple[int, str]] = []
    if req.system:
        text = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": text})
    for m in req.messages:
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(b.text for b in blocks if b.type == "text")}
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in blocks
                if b.type == "tool_use"
            ]
            if calls:
                msg["tool_calls"] = calls
            thought = "".join(b.thinking for b in blocks if b.type == "thinking")
            if thought:
                msg["reasoning_content"] = thought
            messages.append(msg)
            continue
        for b in blocks:  # a user turn's tool results come first, as the tool messages they answer
            if b.type == "tool_result":
                messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        parts = [b for b in blocks if b.type in ("text", "image")]
        if not parts:
            continue
        at = len(messages)
        images += [(at, b.source.as_url()) for b in parts if b.type == "image"]
        if multimodal:
            content: Any = [
                {"type": "image"} if b.type == "image" else {"type": "text", "text": b.text} for b in parts
            ]
        else:
            content = "".join(b.text for b in parts if b.type == "text")
        messages.append({"role": "user", "content": content})
    tools = None
    if req.tools:
        tools = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
                                              "parameters": t.input_schema}}
            for t in req.tools
        ]  # fmt: skip
    mode: str | dict = "none"
    tc = req.tool_choice
    if tools:
        mode = "auto"
        if tc is not None:
            if tc.type == "tool" and not tc.name:
                raise APIError(400, "tool_choice of type tool needs a name", param="tool_choice")
            mode = {"auto": "auto", "any": "required", "none": "none"}.get(tc.type) or {
                "type": "function",
                "function": {"name": tc.name},
            }
    elif tc is not None and tc.type not in ("none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    kwargs = None
    if req.thinking is not None:
        kwargs = {"enable_thinking": req.thinking.type != "disabled"}
    oc = getattr(req, "output_config", None)  # a Messages request's (count_tokens has none)
    effort = oc.effort if oc is not None else None
    return ChatInput(
        messages=messages,
        images=images,
        tools=tools,
        tool_mode=mode,
        parallel_tool_calls=not (tc is not None and tc.disable_parallel_tool_use),
        chat_template_kwargs=kwargs,
        reasoning_effort={"xhigh": "high", "max": "high"}.get(effort, effort) if effort else None,
        grammar_source="output_config" if oc is not None and oc.format is not None else None,
    )


def sampling_params(req: MessagesRequest, cap: int | None) -> SamplingParams:
    t = req.thinking
    budget = t.budget_tokens if t is not None and t.type == "enabled" else None
    fmt = req.output_config.format if req.output_config is not None else None
    try:
        return SamplingParams(
            max_tokens=min(req.max_tokens, cap) if cap else req.max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            stop=tuple(req.stop_sequences or ()),
            thinking_budget=budget,
            structured=OutputConstraint.json_schema(fmt.schema_) if fmt is not None else None,
        )
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


def stop_reason(out: ChoiceOutput, final) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, the stop sequence that ended it)."""
    if out.calls:
        return "tool_use", None
    if final.finish_reason is FinishReason.LENGTH:
        return "max_tokens", None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


def blocks_of(out: ChoiceOutput) -> list[dict]:
    """A finished choice's content blocks."""
    msg = out.message()
    blocks: list[dict] = []
    if msg.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
    if msg.get("content"):
        blocks.append({"type": "text", "text": msg["content"]})
    for c in out.calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    return blocks


def event(kind: str, body: dict) -> bytes:
    data = json.dumps({"type": kind, **body}, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


def error_body(e: APIError) -> dict:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


class _Blocks:
    """A stream's open content block: each event continues it or closes it and opens the next."""

    def __init__(self):
        self.index, self.kind = -1, None

    def feed(self, e) -> list[bytes]:
        out = []
        if isinstance(e, ToolCallDelta):
            if e.id is not None:  # a new call: its own block
                out += self._open("tool_use", {"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
            if e.arguments:
                delta = {"type": "input_json_delta", "partial_json": e.arguments}
                out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
            return out
        kind, key, start = (
            ("thinking", "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            if isinstance(e, ReasoningDelta)
            else ("text", "text", {"type": "text", "text": ""})
        )
        if self.kind != kind:
            out += self._open(kind, start)
        delta = {"type": f"{key}_delta", key: e.text}
        out.append(event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"index": self.index})]


def router(loop, processor, cfg, names: set[str], model_name: str, prompts) -> APIRouter:
    r = APIRouter()

    def anthropic_errors(handler):
        async def wrapped(request: Request):
            try:
                return await handler(request)
            except APIError as e:
                return JSONResponse(error_body(e), status_code=e.status, headers=e.headers)

        wrapped.__name__ = handler.__name__
        return wrapped

    async def prepare(request: Request, model_cls):
        req = await read_model(request, model_cls, cfg.max_body_bytes, cfg.body_timeout)
        if req.model not in names:
            raise APIError(404, f"model '{req.model}' does not exist; this server serves '{model_name}'")
        return req, chat_input(req, processor.info.is_multimodal)

    async def count_tokens(request: Request):
        req, chat = await prepare(request, CountTokensRequest)
        rid = new_request_id("count")
        choices, _ = await prompts.chat(chat, SamplingParams(max_tokens=1), rid, None)
        return JSONResponse({"input_tokens": len(choices[0].prompt_token_ids)})

    async def messages(request: Request):
        req, chat = await prepare(request, MessagesRequest)
        rid = new_request_id("msg")
        request.state.request_id = rid
        params = sampling_params(req, cfg.max_tokens)
        salt = request.state.tenant
        choices, plan = await prompts.chat(chat, params, rid, None if salt is None else f"{salt}\x00")
        stream = loop.submit(rid, choices, streaming=req.stream, timeout=cfg.request_timeout, tenant=salt)
        try:
            await stream.admitted()
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        out = ChoiceOutput(plan)
        head = {"id": rid, "type": "message", "role": "assistant", "model": req.model}
        if req.stream:
            return StreamingResponse(
                streamed(stream, out, head, len(choices[0].prompt_token_ids)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        final = await run_whole(loop, stream, out)
        reason, seq = stop_reason(out, final)
        usage = {"input_tokens": final.num_prompt_tokens, "output_tokens": final.num_output_tokens}
        body = {**head, "content": blocks_of(out), "stop_reason": reason, "stop_sequence": seq}
        return JSONResponse({**body, "usage": usage})

    async def streamed(stream, out: ChoiceOutput, head: dict, prompt_tokens: int):
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0}
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        yield event("message_start", {"message": start})
        yield event("ping", {})
        blocks = _Blocks()
        try:
            async for _, d in stream.deltas():
                for e in events_of(out, d):
                    if isinstance(e, ContentDelta | ReasoningDelta | ToolCallDelta):
                        for chunk in blocks.feed(e):
                            yield chunk
                if d.finished:
                    for chunk in blocks.close():
                        yield chunk
                    if d.error:
                        yield event("error", error_body(APIError(500, d.error)))
                        return
                    reason, seq = stop_reason(out, d)
                    delta = {"stop_reason": reason, "stop_sequence": seq}
                    used = {"output_tokens": d.num_output_tokens}
                    yield event("message_delta", {"delta": delta, "usage": used})
                    yield event("message_stop", {})
        except StreamFailed as e:
            yield event("error", error_body(from_stream_error(e.error)))
        finally:
            if not stream.finished:
                loop.abort(stream.request_id)

    r.add_api_route("/v1/messages", anthropic_errors(messages), methods=["POST"])
    r.add_api_route("/v1/messages/count_tokens", anthropic_errors(count_tokens), methods=["POST"])
    return r
