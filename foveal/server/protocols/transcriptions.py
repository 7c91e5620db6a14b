"""OpenAI's `POST /v1/audio/transcriptions`, as vLLM serves it on models that hear: a multipart form
with the audio `file`, decoded and resampled like a chat's audio part, then asked for its transcript
through the model's own chat template (one user turn: the clip, then the instruction; `language` and
`prompt` join the instruction). Greedy unless `temperature`. `response_format`: json ({"text"}), text
(the transcript alone), verbose_json (task, language, duration, text, and one segment spanning the
clip: these models give no timestamps). `stream=true`: OpenAI's events, `transcript.text.delta` as
the text comes, then `transcript.text.done` with the whole text and the usage. The request is an
ordinary engine request: batched with the rest, cancelled when the client leaves, metered like a chat.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.datastructures import UploadFile

from foveal.engine.loop import StreamFailed
from foveal.parsing.output import ChoiceOutput
from foveal.parsing.tools import ContentDelta
from foveal.request import SamplingParams, new_request_id
from foveal.server.body import read_form
from foveal.server.chat_input import ChatInput
from foveal.server.errors import APIError, from_stream_error
from foveal.server.protocols.whole import events_of, run_whole
from foveal.server.sse import sse

log = logging.getLogger(__name__)

INSTRUCTION = "Transcribe the audio exactly. Reply with the transcript only."
FORMATS = ("json", "text", "verbose_json")
_FORM_SLACK = 64 * 1024  # the form's own fields and boundaries beside the file
_MAX_PROMPT_CHARS = 4096


def _text_field(form, name: str, limit: int) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise APIError(400, f"{name} must be a text field", param=name)
    if len(value) > limit:
        raise APIError(400, f"{name} is over {limit} characters", param=name)
    return value


def _temperature(form) -> float:
    raw = _text_field(form, "temperature", 32)
    if raw is None:
        return 0.0
    try:
        t = float(raw)
    except ValueError:
        raise APIError(400, f"temperature must be a number, got {raw!r}", param="temperature") from None
    if not 0.0 <= t <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {t:g}", param="temperature")
    return t


def instruction(language: str | None, prompt: str | None) -> str:
    text = INSTRUCTION
    if language:
        text = f"The speech is in {language}. " + text
    if prompt:
        text += f" Context (names and spellings to follow): {prompt}"
    return text


def router(loop, processor, cfg, names: set[str], model_name: str, prompts) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        form = await read_form(request, cfg.max_audio_bytes + _FORM_SLACK, cfg.body_timeout)
        model = _text_field(form, "model", 256)
        if model is not None and model not in names:
            raise APIError(
                404, f"model '{model}' does not exist; this server serves '{model_name}'", param="model",
                code="model_not_found",
            )  # fmt: skip
        if processor.audio_sampling_rate is None:
            raise APIError(400, f"model '{processor.info.model_name}' does not accept audio", param="model")
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise APIError(400, "file is required: the audio to transcribe, as a form file", param="file")
        data = await upload.read()
        if not data:
            raise APIError(400, "file is empty", param="file")
        fmt = _text_field(form, "response_format", 32) or "json"
        if fmt not in FORMATS:
            allowed = ", ".join(FORMATS)
            raise APIError(
                400, f"response_format must be one of {allowed}, not {fmt!r}", param="response_format"
            )
        streaming = (_text_field(form, "stream", 8) or "false").lower()
        if streaming not in ("true", "1", "false", "0"):
            raise APIError(400, f"stream must be true or false, not {streaming!r}", param="stream")
        streaming = streaming in ("true", "1")
        language = _text_field(form, "language", 32)
        text = instruction(language, _text_field(form, "prompt", _MAX_PROMPT_CHARS))
        chat = ChatInput(
            messages=[{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": text}]}],
            audios=[(0, data)],
        )
        rid = new_request_id("trsc")
        request.state.request_id = rid
        params = SamplingParams(
            temperature=_temperature(form), max_tokens=None, default_max_tokens=cfg.max_tokens
        )
        salt = request.state.tenant
        choices, plan = await prompts.chat(chat, params, rid, None if salt is None else f"{salt}\x00")
        stream = loop.submit(rid, choices, streaming=streaming, timeout=cfg.request_timeout, tenant=salt)
        try:
            await stream.admitted()
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        out = ChoiceOutput(plan)
        if streaming:
            return StreamingResponse(
                _events(loop, stream, out),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        final = await run_whole(loop, stream, out)
        transcript = out.message().get("content") or ""
        usage = _usage(final)
        if fmt == "text":
            return PlainTextResponse(transcript)
        if fmt == "json":
            return JSONResponse({"text": transcript, "usage": usage})
        seconds = _duration(choices[0])
        segment = {"id": 0, "start": 0.0, "end": seconds, "text": transcript}
        body = {"task": "transcribe", "language": language or "", "duration": seconds, "text": transcript}
        return JSONResponse({**body, "segments": [segment], "usage": usage})

    return r


def _usage(final) -> dict:
    used = (final.num_prompt_tokens, final.num_output_tokens)
    return {"type": "tokens", "input_tokens": used[0], "output_tokens": used[1], "total_tokens": sum(used)}


async def _events(loop, stream, out: ChoiceOutput):
    """OpenAI's transcription events: a delta per piece of text, then the whole text and the usage (an
    `error` event if the request fails mid-way)."""
    try:
        async for _, d in stream.deltas():
            for e in events_of(out, d):
                if isinstance(e, ContentDelta) and e.text:
                    yield sse({"type": "transcript.text.delta", "delta": e.text})
            if d.finished:
                if d.error:
                    yield sse({"type": "error", "error": {"message": d.error, "type": "server_error"}})
                    return
                text = out.message().get("content") or ""
                yield sse({"type": "transcript.text.done", "text": text, "usage": _usage(d)})
    except StreamFailed as e:
        err = from_stream_error(e.error)
        yield sse({"type": "error", "error": {"message": err.message, "type": err.type}})
    finally:
        if not stream.finished:
            loop.abort(stream.request_id)


def _duration(req) -> float:
    """The clip's length in seconds (every audio item carries it: models/vlm.py audio_inputs)."""
    (item,) = [it for it in req.mm_items if it.modality == "audio"]
    return round(float(item.data["seconds"]), 3)
