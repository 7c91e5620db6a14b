"""OutputConstraint: what a request asks its output to match, as one frozen, hashable value.

Owns the request shapes that carry a constraint and their validation: OpenAI's `response_format`
(`json_schema`, `json_object`, `text`), vLLM's `structured_outputs` object and its older `guided_json` /
`guided_regex` / `guided_choice` / `guided_grammar` fields. A malformed shape is a ValueError that
names the field, raised before anything is compiled. It must not compile anything or import a grammar
engine: whether a well-formed schema, regex or grammar is *valid* is the backend's question.

The value is canonical text so that equal constraints hash equal (the grammar cache's key):

    json_schema  the schema as compact JSON, key order kept (property order is what the output
                 follows: llguidance emits properties in the order the schema lists them)
    json_object  ""  (any JSON object)
    regex        the pattern (llguidance's dialect: Rust's `regex` crate, full match)
    choice       a JSON list of the strings; the output is exactly one of them
    lark         the grammar text (llguidance's Lark dialect; the backend converts GBNF)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")
_JSON_KINDS = ("json_schema", "json_object")

# vLLM's StructuredOutputsParams fields: the constraints (exactly one) and the options we honour
_SO_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_OPTIONS = (
    "disable_any_whitespace",
    "whitespace_pattern",
    "disable_additional_properties",
    "disable_fallback",
)


@dataclass(frozen=True, slots=True)
class OutputConstraint:
    """One output constraint. Build it with the constructors below, which validate and canonicalize;
    the JSON options (whitespace, lenient) must stay at their defaults for the other kinds."""

    kind: GrammarKind
    value: str
    whitespace_flexible: bool = True  # JSON: any whitespace between tokens (False: none at all)
    whitespace_pattern: str | None = None  # JSON: a regex for that whitespace instead
    lenient: bool = False  # json_schema: best effort (unenforceable keywords ignored, oneOf as anyOf)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if not isinstance(self.value, str):
            raise ValueError(f"{self.kind}: the value must be text, got {type(self.value).__name__}")
        if self.kind not in _JSON_KINDS and (
            not self.whitespace_flexible or self.whitespace_pattern is not None or self.lenient
        ):
            raise ValueError(f"{self.kind}: whitespace and lenient options apply to JSON kinds only")

    # -- constructors -----------------------------------------------------------------------------
    @classmethod
    def json_schema(
        cls,
        schema: Any,
        *,
        whitespace_flexible: bool = True,
        whitespace_pattern: str | None = None,
        lenient: bool = False,
    ) -> OutputConstraint:
        """A JSON schema given as a dict, a bool (`true`: any JSON value) or JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: the schema is not valid JSON ({e})") from None
        if schema is True:
            schema = {}
        elif schema is False:
            raise ValueError("json_schema: the schema `false` matches nothing")
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema: the schema must be a JSON object, got {_json_type(schema)}")
        if whitespace_pattern is not None and not isinstance(whitespace_pattern, str):
            raise ValueError("json_schema: whitespace_pattern must be a string")
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError) as e:  # NaN, or a value JSON cannot hold
            raise ValueError(f"json_schema: the schema is not valid JSON ({e})") from None
        return cls("json_schema", text, bool(whitespace_flexible), whitespace_pattern, bool(lenient))

    @classmethod
    def json_object(
        cls, *, whitespace_flexible: bool = True, whitespace_pattern: str | None = None
    ) -> OutputConstraint:
        return cls("json_object", "", bool(whitespace_flexible), whitespace_pattern)

    @classmethod
    def regex(cls, pattern: Any) -> OutputConstraint:
        if not isinstance(pattern, str):
            raise ValueError(f"regex: the pattern must be a string, got {_json_type(pattern)}")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: Any) -> OutputConstraint:
        if not isinstance(choices, (list, tuple)) or not choices:
            raise ValueError("choice: expected a non-empty list of strings")
        for i, c in enumerate(choices):
            if not isinstance(c, str):
                raise ValueError(f"choice: item {i} is {_json_type(c)}, expected a string")
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    @classmethod
    def lark(cls, grammar: Any) -> OutputConstraint:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError("grammar: expected a non-empty grammar string (Lark, or GBNF)")
        return cls("lark", grammar)

    # -- API shapes -------------------------------------------------------------------------------
    @classmethod
    def from_response_format(cls, response_format: Any) -> OutputConstraint | None:
        """OpenAI's `response_format`; None for `{"type": "text"}` (no constraint). `strict` is accepted
        and changes nothing: every constraint is enforced fully, and what cannot be enforced is refused."""
        rf = _object(response_format, "response_format")
        _only(rf, ("type", "json_schema"), "response_format")
        kind = rf.get("type")
        if kind == "text" or kind == "json_object":
            if "json_schema" in rf:
                raise ValueError(f"response_format: `json_schema` does not go with type {kind!r}")
            return None if kind == "text" else cls.json_object()
        if kind != "json_schema":
            raise ValueError(
                f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
            )
        js = _object(rf.get("json_schema"), "response_format.json_schema")
        _only(js, ("name", "description", "schema", "strict"), "response_format.json_schema")
        name = js.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("response_format.json_schema.name is required (a non-empty string)")
        if js.get("description") is not None and not isinstance(js["description"], str):
            raise ValueError("response_format.json_schema.description must be a string")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise ValueError("response_format.json_schema.strict must be a boolean")
        schema = js.get("schema")
        if schema is None:  # OpenAI makes the schema optional: then any JSON value
            schema = {}
        elif not isinstance(schema, (dict, bool)):
            raise ValueError(
                f"response_format.json_schema.schema must be a JSON object, got {_json_type(schema)}"
            )
        return _prefixed("response_format.json_schema.schema", cls.json_schema, schema)

    @classmethod
    def from_structured_outputs(cls, so: Any) -> OutputConstraint | None:
        """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object
        (None when none is set), plus disable_any_whitespace and whitespace_pattern for JSON.
        structural_tag and disable_additional_properties are refused (not implemented);
        disable_fallback is accepted (there is one backend, nothing to fall back to)."""
        so = _object(so, "structured_outputs")
        _only(so, _SO_CONSTRAINTS + _SO_OPTIONS, "structured_outputs")
        set_ = [k for k in _SO_CONSTRAINTS if so.get(k) is not None and so.get(k) is not False]
        if len(set_) > 1:
            raise ValueError(f"structured_outputs: set only one of {', '.join(set_)}")
        for k in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if so.get(k) is not None and not isinstance(so[k], bool):
                raise ValueError(f"structured_outputs.{k} must be a boolean")
        if so.get("disable_additional_properties"):
            raise ValueError("structured_outputs.disable_additional_properties is not supported")
        ws_flex = not so.get("disable_any_whitespace", False)
        ws_pat = so.get("whitespace_pattern")
        if ws_pat is not None and not isinstance(ws_pat, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string")
        if not set_:
            return None
        key = set_[0]
        if key not in ("json", "json_object") and (not ws_flex or ws_pat is not None):
            raise ValueError(f"structured_outputs: whitespace options apply to json, not {key}")
        where = f"structured_outputs.{key}"
        v = so[key]
        if key == "json":
            return _prefixed(
                where, cls.json_schema, v, whitespace_flexible=ws_flex, whitespace_pattern=ws_pat
            )
        if key == "json_object":
            if v is not True:
                raise ValueError(f"{where} must be a boolean")
            return cls.json_object(whitespace_flexible=ws_flex, whitespace_pattern=ws_pat)
        if key == "structural_tag":
            raise ValueError("structured_outputs.structural_tag is not supported")
        build = {"regex": cls.regex, "choice": cls.choice, "grammar": cls.lark}[key]
        return _prefixed(where, build, v)

    @classmethod
    def from_guided(
        cls,
        *,
        guided_json: Any = None,
        guided_regex: Any = None,
        guided_choice: Any = None,
        guided_grammar: Any = None,
        guided_whitespace_pattern: Any = None,
    ) -> OutputConstraint | None:
        """vLLM's older request fields (`guided_json` ...); None when none is set."""
        so = {"json": guided_json, "regex": guided_regex, "choice": guided_choice, "grammar": guided_grammar}
        if guided_whitespace_pattern is not None:
            so["whitespace_pattern"] = guided_whitespace_pattern
        try:
            return cls.from_structured_outputs(so)
        except ValueError as e:  # name the fields the client sent
            msg = str(e).replace("structured_outputs.", "guided_").replace("structured_outputs", "guided_*")
            raise ValueError(msg) from None

    # -- identity ---------------------------------------------------------------------------------
    def digest(self) -> str:
        """A stable sha256 of the constraint (the same in every process): for logs and metrics labels."""
        parts = (
            self.kind,
            self.value,
            str(self.whitespace_flexible),
            str(self.whitespace_pattern),
            str(self.lenient),
        )
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def describe(self, limit: int = 60) -> str:
        """A short human label, e.g. `regex '[0-9]+'`."""
        v = self.value if len(self.value) <= limit else self.value[: limit - 3] + "..."
        return self.kind if self.kind == "json_object" else f"{self.kind} {v!r}"


def _json_type(x: Any) -> str:
    if x is None:
        return "null"
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "an array",
        tuple: "an array",
        dict: "an object",
    }.get(type(x), type(x).__name__)


def _object(x: Any, where: str) -> dict:
    if not isinstance(x, dict):
        raise ValueError(f"{where} must be an object, got {_json_type(x)}")
    return x


def _only(d: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(k for k in d if k not in allowed)
    if extra:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, extra))}")


def _prefixed(where: str, build, *args, **kwargs) -> OutputConstraint:
    """Call a constructor, naming the request field in its error."""
    try:
        return build(*args, **kwargs)
    except ValueError as e:
        msg = str(e)
        kind, _, rest = msg.partition(": ")
        raise ValueError(f"{where}: {rest if kind in KINDS or kind == 'grammar' else msg}") from None
