"""OpenAI error JSON: {"error": {"message", "type", "param", "code"}}, and the mapping from pydantic
validation errors to one message that names the offending field. Owns no routes."""

from __future__ import annotations

from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


# the engine's ErrorKind values (engine/loop.py) -> HTTP status
STATUS_OF_KIND = {"invalid_request_error": 400, "rate_limit": 429, "unavailable": 503, "timeout": 504}


def from_stream_error(err) -> APIError:
    """An engine StreamError as the API's error: its kind's status (500 for a server error), and a
    Retry-After for a full queue."""
    status = STATUS_OF_KIND.get(err.kind.value, 500)
    headers = {"Retry-After": "1"} if status == 429 else None
    return APIError(status, err.message, err.type, headers=headers)


def error_response(e: APIError, request_id: str | None = None) -> JSONResponse:
    body = {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}
    headers = dict(e.headers or {})
    if request_id:
        headers["X-Request-Id"] = request_id
    return JSONResponse(body, status_code=e.status, headers=headers)


def from_validation(err: ValidationError) -> APIError:
    """The first pydantic error, phrased for an API user: `field.path: what is wrong`."""
    errors = err.errors(include_url=False)
    # for a union field the deepest error is the most specific (e.g. a bad content part's type)
    # (and of equally deep ones, a broken constraint over a type mismatch: the value had the right type
    # for that member, so that member is what the client meant)
    first = max(
        errors,
        key=lambda e: (
            len([x for x in e.get("loc", ()) if not _is_union_tag(x)]),
            not e.get("type", "").endswith("_type"),
        ),
    )
    loc = [str(x) for x in first.get("loc", ()) if not _is_union_tag(x)]
    # a discriminated union repeats its tag ('image_url.image_url.url'): drop the repeat
    loc = [x for i, x in enumerate(loc) if i == 0 or x != loc[i - 1]]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"unsupported parameter '{param}': this server does not implement it"
    elif kind == "missing":
        msg = f"missing required parameter '{param}'"
    elif kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json")
    elif param:
        msg = f"invalid value for '{param}': {first.get('msg')}"
    else:
        msg = f"invalid request body: {first.get('msg')}"
    return APIError(400, msg, param=param, code=kind or None)


def _is_union_tag(x) -> bool:
    # pydantic puts the union member's type name in loc (e.g. 'str', 'list[int]',
    # 'function-before[_integral(), int]'); drop those, and only those ('functions' is a field name)
    return isinstance(x, str) and (
        x in ("str", "int", "float", "bool")
        or "[" in x
        or x.startswith("constrained-")
        or (x[:1].isupper() and x.isidentifier())  # a model class of ours (NamedToolChoice); fields are lower
    )
