"""Typing raw parameter text by the tool's JSON schema, for the formats that write values unquoted
(Qwen XML, GLM, DeepSeek DSML).

`coerce(raw, schema)`: the schema's types (`type`, type lists, anyOf/oneOf/allOf, enum, const)
decide. `null` / `None` is null where null is allowed; a string type keeps the text exactly;
otherwise integer, number, boolean (`true` / `True`), object / array (JSON, or a Python literal) in
that order. Text that fits no allowed type stays a string (the model wrote it; it is passed on).
Without a schema, `untyped` decides: "structured" decodes JSON objects/arrays only (Qwen writes
every value raw), "json" decodes any JSON value (GLM writes non-strings as JSON).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from foveal.parsing.tool_formats.base import load_json

_TYPE_ORDER = ("integer", "number", "boolean", "object", "array")
_INT = re.compile(r"[+-]?\d+")


def schema_types(schema: Any) -> list[str]:
    """The JSON types a schema allows, in the order it names them."""
    out: list[str] = []

    def add(t: str) -> None:
        if t not in out:
            out.append(t)

    def walk(s: Any, depth: int = 0) -> None:
        if not isinstance(s, dict) or depth > 8:
            return
        t = s.get("type")
        for x in [t] if isinstance(t, str) else t if isinstance(t, list) else []:
            if isinstance(x, str):
                add(x)
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in s.get(key) or []:
                walk(sub, depth + 1)
        for v in list(s.get("enum") or []) + ([s["const"]] if "const" in s else []):
            add(_json_type(v))
        if not out and "properties" in s:
            add("object")
        if not out and "items" in s:
            add("array")

    walk(schema)
    return out


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    return {list: "array", dict: "object"}.get(type(v), "string")


def coerce(raw: str, schema: dict | None, untyped: str = "structured") -> Any:
    """A parameter's raw text as the JSON value its schema asks for (see the module docstring)."""
    types = schema_types(schema)
    s = raw.strip()
    if not types:
        if untyped == "json":
            try:
                return load_json(s)
            except ValueError:
                return raw
        value = _structured(s) if s[:1] in ("{", "[") else None
        return raw if value is None else value
    if "null" in types and s in ("null", "None"):
        return None
    if "string" in types:
        return raw
    for t in _TYPE_ORDER:
        if t not in types:
            continue
        if t == "integer" and _INT.fullmatch(s):
            return int(s)
        if t in ("integer", "number"):
            number = _number(s)
            if number is not None and (t == "number" or float(number).is_integer()):
                return int(number) if t == "integer" else number
        if t == "boolean" and s.lower() in ("true", "false"):
            return s.lower() == "true"
        if t in ("object", "array"):
            value = _structured(s)
            if isinstance(value, dict if t == "object" else list):
                return value
    return raw


def _number(s: str) -> int | float | None:
    try:
        v = load_json(s)
    except ValueError:
        try:
            v = float(s)
        except ValueError:
            return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return v


def _structured(s: str) -> dict | list | None:
    """JSON object/array text, or the same as a Python literal (single quotes, True/None)."""
    try:
        v = load_json(s)
    except ValueError:
        try:
            v = json.loads(json.dumps(ast.literal_eval(s), allow_nan=False))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    return v if isinstance(v, dict | list) else None
