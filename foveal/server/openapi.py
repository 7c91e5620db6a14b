"""The served OpenAPI document (/openapi.json) with the real request bodies. The routes read and validate
their bodies themselves (size and time caps, strict models, OpenAI-shaped errors: server/body.py,
protocol.py), so FastAPI cannot see the models; this publishes the same pydantic models it validates
with, so what clients and fuzzers learn from the document is what the server accepts."""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi
from pydantic.json_schema import models_json_schema

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERRORS = {
    "400": "invalid request (the message names the field)",
    "401": "invalid or missing API key",
    "404": "unknown model",
    "408": "request body not received in time",
    "413": "request body or its images too large",
    "429": "queue full or too much image work in flight; see Retry-After",
    "503": "not accepting requests (loading, draining, dead)",
    "504": "no output within the request timeout",
}


def publish_request_bodies(app, bodies: dict) -> None:
    """bodies: POST path -> the pydantic model of its JSON body."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        refs, defs = models_json_schema(
            [(m, "validation") for m in bodies.values()], ref_template="#/components/schemas/{model}"
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(defs.get("$defs", {}))
        schemas["Error"] = _ERROR
        for path, model in bodies.items():
            op = doc["paths"][path]["post"]
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": refs[(model, "validation")]}},
            }
            op.setdefault("responses", {}).update(
                {
                    code: {
                        "description": what,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                    }
                    for code, what in _ERRORS.items()
                }
            )
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
