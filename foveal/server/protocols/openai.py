"""OpenAI's chat completions and completions: body parsing into the strict pydantic models of
foveal/server/protocol.py (a model name may pick a served LoRA adapter), submission to the EngineLoop,
whole and streamed (SSE) responses in OpenAI's shapes (foveal/server/sse.py). A chat request becomes
the neutral ChatInput (server/chat_input.py) its reply is parsed from, as every chat protocol's does.

Every 4xx is decided before any response byte is sent: the stream's first item is admission or an
error. A client that goes away (mid-stream or before the first token) aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from foveal.engine.loop import RequestStream, StreamFailed
from foveal.parsing.output import ChoiceOutput, OutputPlan
from foveal.request import new_request_id
from foveal.server import sse
from foveal.server.body import read_model
from foveal.server.errors import APIError, from_stream_error
from foveal.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)


def _chat_finish(out: ChoiceOutput, reason: str | None) -> str | None:
    """OpenAI's finish_reason of a chat choice: "tool_calls" when the model stopped after calling."""
    return "tool_calls" if reason == "stop" and out.calls else reason


def router(loop, processor, cfg, names: set[str], model_name: str, prompts) -> APIRouter:
    """The two routes, given the app's engine loop, input processor, server config, served names and
    input side (server/prompts.py)."""
    r = APIRouter()
    info = processor.info
    text_of = sse.TokenText(processor.tokenizer)

    async def parse(request: Request, model_cls):
        req = await read_model(request, model_cls, cfg.max_body_bytes, cfg.body_timeout)
        adapter = None
        if req.model is not None and req.model not in names:
            adapter = await lora_adapter(req.model)
        try:
            params = req.sampling_params()  # validated as it is made (request.py)
            cap = cfg.max_tokens  # the server's default (where the context leaves that many), and its cap
            if cap is not None:
                mt = params.max_tokens if params.max_tokens is None else min(params.max_tokens, cap)
                params = dataclasses.replace(params, max_tokens=mt, default_max_tokens=cap)
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        return req, params, adapter

    async def lora_adapter(name: str):
        """The LoRA adapter served as `name` (read again from its path if its host copy was dropped);
        404 listing the served names when there is none."""
        reg = processor.lora
        adapter = None
        if reg is not None:
            try:
                adapter = await asyncio.to_thread(reg.get, name)
            except ValueError as e:  # AdapterError: its files changed or went away since it was loaded
                raise APIError(400, f"LoRA adapter '{name}' cannot be read: {e}", param="model") from None
        if adapter is None:
            served = ", ".join(f"'{n}'" for n in [model_name, *(reg.names() if reg is not None else [])])
            raise APIError(
                404, f"model '{name}' does not exist; this server serves {served}", param="model",
                code="model_not_found",
            )  # fmt: skip
        return adapter

    def with_adapter(choices: list, adapter) -> list:
        return choices if adapter is None else [dataclasses.replace(c, lora=adapter) for c in choices]

    async def admit(request: Request, stream: RequestStream) -> None:
        try:
            await stream.admitted()
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        except BaseException:
            loop.abort(stream.request_id)  # cancelled before admission was answered
            raise

    async def watch_disconnect(request: Request, rid: str) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.2)
        log.info("%s: client disconnected; aborting", rid)
        loop.abort(rid)

    def cache_salt(request: Request, req) -> str | None:
        """The prefix-cache salt: the authenticated tenant, then (only if the operator allows it) a
        client-chosen salt, which can split the tenant's cache further but never reach another's."""
        tenant = request.state.tenant
        client = None
        if cfg.allow_client_cache_salt:
            client = request.headers.get("x-tenant-id") or req.cache_salt
        if tenant is None and client is None:
            return None
        return f"{tenant or ''}\x00{client or ''}"

    async def run(request: Request, rid: str, req, choices: list, plan: OutputPlan | None):
        """choices: the processed sequences; choice index = prompt index * n + choice, as OpenAI
        numbers them. plan: how a chat choice's text is parsed (None: a completion, raw text)."""
        chat = plan is not None
        request.state.request_id = rid
        stream = loop.submit(
            rid, choices, streaming=req.stream, timeout=cfg.request_timeout, tenant=request.state.tenant
        )
        await admit(request, stream)
        if req.stream:
            gen = stream_chat(stream, req, plan) if chat else stream_completion(stream, req)
            return StreamingResponse(
                gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        watcher = asyncio.create_task(watch_disconnect(request, rid))
        try:
            return JSONResponse(await collect(stream, req, plan))
        finally:
            watcher.cancel()
            if not stream.finished:
                loop.abort(rid)

    async def collect(stream: RequestStream, req, plan: OutputPlan | None) -> dict:
        n, chat = stream.num_choices, plan is not None
        texts, lps, reasons = [""] * n, [None] * n, [None] * n
        outs = [ChoiceOutput(plan) for _ in range(n)] if chat else []
        tally = sse.Tally(req.n)
        try:
            async for i, d in stream.deltas():
                texts[i] += d.text
                if chat:
                    outs[i].feed(d.text)
                if d.logprobs:
                    if chat:
                        lps[i] = (lps[i] or []) + d.logprobs
                    else:
                        new = sse.completion_logprobs(d.logprobs, text_of, len(texts[i]) - len(d.text))
                        lps[i] = sse.merge_completion_logprobs(lps[i], new)
                if d.finished:
                    if d.error:
                        status = 400 if d.error_type == "invalid_request_error" else 500
                        raise APIError(status, f"generation failed: {d.error}", d.error_type)
                    reasons[i] = sse.finish(d.finish_reason)
                    if chat:
                        outs[i].finish(truncated=reasons[i] == "length")
                        reasons[i] = _chat_finish(outs[i], reasons[i])
                    tally.add(i, d)
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        if chat:
            choices = [
                {
                    "index": i,
                    "message": outs[i].message(),
                    "logprobs": sse.chat_logprobs(lps[i], text_of) if lps[i] is not None else None,
                    "finish_reason": reasons[i],
                }
                for i in range(n)
            ]
        else:
            choices = [
                {"index": i, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i]}
                for i in range(n)
            ]
        return {
            "id": stream.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": stream.model or model_name,
            "choices": choices,
            "usage": tally.usage(),
            "system_fingerprint": None,
        }

    def _chunk(stream: RequestStream, obj, choices, usage_field: bool) -> dict:
        c = {
            "id": stream.request_id,
            "object": obj,
            "created": int(time.time()),
            "model": stream.model or model_name,
            "choices": choices,
        }
        if usage_field:
            c["usage"] = None
        return c

    async def framed(stream: RequestStream, obj: str, inc: bool, body, n: int):
        """The SSE frame both endpoints share: the body's chunks, the usage chunk, an in-stream error
        event, abort when the client left early, then [DONE]. `body(tally)` adds to the token tally."""
        rid = stream.request_id
        tally = sse.Tally(n)
        try:
            async for chunk in body(tally):
                yield chunk
            if inc:
                usage = tally.usage()
                yield sse.sse({**_chunk(stream, obj, [], False), "usage": usage})
        except StreamFailed as e:
            yield sse.error_event(e.error.message, e.error.type)
        finally:
            if not stream.finished:
                log.info("%s: stream closed early; aborting", rid)
                loop.abort(rid)
        yield sse.DONE

    def stream_chat(stream: RequestStream, req: ChatCompletionRequest, plan: OutputPlan):
        inc = req.include_usage
        obj = "chat.completion.chunk"
        outs = [ChoiceOutput(plan) for _ in range(stream.num_choices)]

        def choice(i, delta, lp=None, fr=None):
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": fr}

        async def body(tally):
            for i in range(stream.num_choices):
                yield sse.sse(_chunk(stream, obj, [choice(i, {"role": "assistant", "content": ""})], inc))
            async for i, d in stream.deltas():
                reason = sse.finish(d.finish_reason)
                events = outs[i].feed(d.text)
                if d.finished:
                    events += outs[i].finish(truncated=reason == "length")
                frags = [e.to_openai() for e in events]
                lp = sse.chat_logprobs(d.logprobs, text_of) if d.logprobs else None
                if lp and not frags:
                    frags = [{"content": ""}]  # the step's logprobs, though its text is held back
                for k, frag in enumerate(frags):  # the step's logprobs ride on its first fragment
                    yield sse.sse(_chunk(stream, obj, [choice(i, frag, lp if k == 0 else None)], inc))
                if d.finished:
                    if d.error:
                        yield sse.error_event(d.error, d.error_type)
                    end = choice(i, {}, None, _chat_finish(outs[i], reason))
                    yield sse.sse(_chunk(stream, obj, [end], inc))
                    tally.add(i, d)

        return framed(stream, obj, inc, body, req.n)

    def stream_completion(stream: RequestStream, req: CompletionRequest):
        inc = req.include_usage
        obj = "text_completion"
        offsets = [0] * stream.num_choices

        async def body(tally):
            async for i, d in stream.deltas():
                if d.text or d.logprobs or d.finished:
                    lp = sse.completion_logprobs(d.logprobs, text_of, offsets[i]) if d.logprobs else None
                    offsets[i] += len(d.text)
                    c = {
                        "index": i,
                        "text": d.text,
                        "logprobs": lp,
                        "finish_reason": sse.finish(d.finish_reason),
                    }
                    yield sse.sse(_chunk(stream, obj, [c], inc))
                if d.finished:
                    if d.error:
                        yield sse.error_event(d.error, d.error_type)
                    tally.add(i, d)

        return framed(stream, obj, inc, body, req.n)

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req, params, adapter = await parse(request, ChatCompletionRequest)
        rid = new_request_id("chatcmpl")
        request.state.request_id = rid
        log.info(
            "%s: chat request, %d message(s), n=%d, stream=%s", rid, len(req.messages), params.n, req.stream
        )
        try:
            chat = req.chat_input(info.is_multimodal)
        except ValueError as e:  # InvalidParameter (tool_choice without tools)
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        choices, plan = await prompts.chat(chat, params, rid, cache_salt(request, req))
        return await run(request, rid, req, with_adapter(choices, adapter), plan)

    @r.post("/v1/completions")
    async def completions(request: Request):
        req, params, adapter = await parse(request, CompletionRequest)
        rid = new_request_id("cmpl")
        request.state.request_id = rid
        choices = with_adapter(await prompts.completion(req, params, rid, cache_salt(request, req)), adapter)
        log.info(
            "%s: completion request, %d sequence(s), n=%d, stream=%s", rid, len(choices), params.n, req.stream
        )
        return await run(request, rid, req, choices, None)

    return r
