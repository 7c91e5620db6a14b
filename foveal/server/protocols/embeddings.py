"""OpenAI's `POST /v1/embeddings`: each input a prefill-only request whose prompt's hidden states the
engine pools (foveal/worker/model_runner.py `_pool`: the last token's, or the mean), L2-normalized;
`dimensions` keeps the first n values and normalizes again (Matryoshka), `encoding_format: base64`
sends little-endian float32 bytes. The inputs of one call are the choices of one engine request:
batched in the same loop as everything else, holding no KV once they finish.
"""

from __future__ import annotations

import base64
import logging
import struct
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from foveal.engine.loop import StreamFailed
from foveal.request import new_request_id
from foveal.server.body import read_model
from foveal.server.errors import APIError, from_stream_error

log = logging.getLogger(__name__)
MAX_INPUTS = 2048  # OpenAI's limit per call


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)


def _vector(values: list[float], dimensions: int | None) -> list[float]:
    """L2-normalized, truncated to `dimensions` first (then normalized again)."""
    if dimensions is not None:
        values = values[:dimensions]
    norm = sum(v * v for v in values) ** 0.5 or 1.0
    return [v / norm for v in values]


def _encode(values: list[float], fmt: str):
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode() if fmt == "base64" else values


def router(loop, processor, cfg, names: set[str], model_name: str, prompts) -> APIRouter:
    """The route, given the app's engine loop, input processor, server config, served names and the
    input pool (`prompts._work`: tokenizing off the event loop, under the input deadline)."""
    r = APIRouter()

    @r.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = await read_model(request, EmbeddingRequest, cfg.max_body_bytes, cfg.body_timeout)
        if req.model is not None and req.model not in names:
            raise APIError(
                404, f"model '{req.model}' does not exist; this server serves '{model_name}'", param="model",
                code="model_not_found",
            )  # fmt: skip
        items = req.inputs()
        if not items or len(items) > MAX_INPUTS:
            raise APIError(400, f"input must hold 1 to {MAX_INPUTS} items, not {len(items)}", param="input")
        rid = new_request_id("embd")
        request.state.request_id = rid

        def build():
            return [processor.embedding_request(x, f"{rid}-{i}") for i, x in enumerate(items)]

        try:
            choices = await prompts._work(build)
        except ValueError as e:
            raise APIError(400, str(e), param="input") from None
        stream = loop.submit(rid, choices, timeout=cfg.request_timeout, tenant=request.state.tenant)
        vectors: list[list[float] | None] = [None] * len(choices)
        tokens = 0
        try:
            await stream.admitted()
            async for i, d in stream.deltas():
                if d.finished:
                    if d.error or d.embedding is None:
                        raise APIError(500, f"embedding failed: {d.error or 'no vector'}")
                    vectors[i] = d.embedding
                    tokens += d.num_prompt_tokens
        except StreamFailed as e:
            raise from_stream_error(e.error) from None
        finally:
            if not stream.finished:
                loop.abort(rid)
        width = len(vectors[0])
        if req.dimensions is not None and req.dimensions > width:
            raise APIError(400, f"dimensions must be at most {width} for this model", param="dimensions")
        out = [_encode(_vector(v, req.dimensions), req.encoding_format) for v in vectors]
        data = [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(out)]
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        body = {"object": "list", "data": data, "model": req.model or model_name, "usage": usage}
        return JSONResponse(body)

    return r
