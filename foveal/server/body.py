"""Reading a request's body (JSON, or a multipart form) safely: one deadline for the whole body (a
client that trickles bytes is cut off, not kept alive by each byte), a size cap, a nesting-depth cap,
and a clean signal when the client leaves mid-body. Owns no routes and knows nothing of the engine;
turning `ClientLeft` into one INFO log line is the app's job."""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing
from itertools import chain, compress

from starlette.datastructures import FormData
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect, Request

from foveal.server.errors import APIError

MAX_DEPTH = 64  # deepest JSON nesting accepted; an OpenAI request needs < 10 (tool schemas a few more)
_CONTAINERS = frozenset((list, dict))  # what json.loads nests (exact types: it makes no subclasses)


class ClientLeft(APIError):
    """The client closed the connection before its body was complete. An APIError (status 499, nginx's
    'client closed request') so that even without a dedicated handler it never becomes a 500 traceback;
    nothing can be sent back anyway."""

    def __init__(self, received: int):
        super().__init__(499, f"client disconnected after {received} body bytes", code="client_left")
        self.received = received


async def read_bytes(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The raw body of `request`. Raises APIError 413 `body_too_large` (Content-Length or streamed size
    over max_bytes), 408 `body_timeout` (the whole body not in within `timeout` seconds), and
    ClientLeft when the client disconnects mid-body."""
    # No `Connection: close` on 413: after an early answer uvicorn reads and drops the rest of the body,
    # for at most the header timeout (foveal.server.transport), so a fast uploader surely reads the 413
    # (closing on unread bytes would send a TCP reset that can destroy it).
    too_big = APIError(413, f"request body exceeds {max_bytes} bytes", code="body_too_large")
    cl = request.headers.get("content-length")
    if cl and cl.isdigit() and int(cl) > max_bytes:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):  # one deadline for the whole body, not per chunk
            async with aclosing(request.stream()) as stream:
                async for c in stream:
                    size += len(c)
                    if size > max_bytes:
                        raise too_big
                    chunks.append(c)
    except TimeoutError:
        raise APIError(
            408,
            f"request body not received within {timeout:g} s ({size} bytes arrived)",
            code="body_timeout",
            headers={"Connection": "close"},  # a stalled client: nothing to drain, free the connection now
        ) from None
    except ClientDisconnect:
        raise ClientLeft(size) from None
    return b"".join(chunks)


async def read_form(request: Request, max_bytes: int, timeout: float, max_fields: int = 32) -> FormData:
    """A multipart/form-data body (one file at most), read whole under the same cap and deadline as a
    JSON body, then parsed by Starlette's parser: 400 `invalid_form` when it is not such a form."""
    kind = request.headers.get("content-type", "")
    if not kind.lower().startswith("multipart/form-data"):
        raise APIError(
            400,
            f"expected a multipart/form-data body, got {kind or 'no content type'!r}",
            code="invalid_form",
        )
    raw = await read_bytes(request, max_bytes, timeout)

    async def once():
        yield raw
        yield b""

    try:
        return await MultiPartParser(request.headers, once(), max_files=1, max_fields=max_fields).parse()
    except MultiPartException as e:
        raise APIError(400, f"malformed form body: {e.message}", code="invalid_form") from None


async def read_json(request: Request, max_bytes: int, timeout: float, max_depth: int = MAX_DEPTH):
    """The parsed JSON body of `request` (any JSON value; the caller checks its shape).

    Raises what read_bytes raises, and 400 `invalid_json` (not JSON, or nested deeper than max_depth)."""
    raw = await read_bytes(request, max_bytes, timeout)
    try:
        data = json.loads(raw)
    except RecursionError:  # the C decoder recurses once per level: ~1000 levels hit the interpreter limit
        raise _too_deep(max_depth) from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if _depth_exceeds(data, max_depth):  # pydantic validation (and our own code) recurses per level too
        raise _too_deep(max_depth)
    # A \ud800-style escape decodes to a lone surrogate: a str that is no Unicode text, which the
    # tokenizer refuses with a TypeError. Only an escape can make one (raw UTF-8 cannot), so only a body
    # with a \ud escape pays for the check.
    if b"\\ud" in raw or b"\\uD" in raw:
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start : e.end].encode("utf-16-be", "surrogatepass").hex()
            raise APIError(
                400,
                f"malformed JSON body: a lone UTF-16 surrogate (\\u{bad}) is not text",
                code="invalid_json",
            ) from None
    return data


def _too_deep(max_depth: int) -> APIError:
    return APIError(
        400, f"malformed JSON body: nested too deeply (more than {max_depth} levels)", code="invalid_json"
    )


def _depth_exceeds(data, max_depth: int) -> bool:
    """Whether `data` nests lists/objects deeper than max_depth. Iterative, one level at a time, so it
    cannot recurse itself; each level's containers are picked out at C speed (chain/compress/map), which
    costs a fraction of what json.loads took for the same body."""
    level, depth = ([data] if type(data) in _CONTAINERS else []), 0
    while level:
        depth += 1
        if depth > max_depth:
            return True
        items = list(chain.from_iterable(v.values() if type(v) is dict else v for v in level))
        level = list(compress(items, map(_CONTAINERS.__contains__, map(type, items))))
    return False


async def read_model(request: Request, model_cls, max_bytes: int, timeout: float):
    """The body as `model_cls` (a pydantic model): read_json's errors, a 400 for a body that is not an
    object, and the validation's errors as 400s naming the field (errors.from_validation)."""
    from pydantic import ValidationError

    from foveal.server.errors import from_validation

    data = await read_json(request, max_bytes, timeout)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None
