"""Tool calls as grammars (llguidance's Lark): a tool-call format's call syntax (`CallSyntax`, which
the format publishes) around each offered function's parameters, so a call's arguments always parse
and validate.

    tool_choice "required"    calls only: one, or several as the format writes them (parallel)
    tool_choice {function}    that one function's call only
    tool_choice "auto"        free text; where the text reaches the format's trigger the call that
                              follows is constrained. A trigger that is text ("<tool_call>") ends the
                              free text through a lazy lexeme; a special token ("[TOOL_CALLS]") cannot
                              occur in text at all, so the free text simply stops where it comes

Formats with a syntax: hermes (Qwen 2.5/3, Hermes, and the generic tool prompt of templates without
tool support), qwen3_xml, mistral (v3 lists, or v11+ `[TOOL_CALLS]name[ARGS]{...}` where the tokenizer
has `[ARGS]`), pythonic (wrapped in `<|python_start|>` where that is a special token, Llama 4) and
llama3_json. A bare JSON object or Python list (llama3_json, pythonic without the wrapper) is a call
only where it opens the output: under auto the output is then a call, or free text that does not
begin like one (`{"name"`, `[name(`). For another format "required" and a named choice are refused
(they would not be enforced), and "auto" stays free.

Arguments: JSON formats take the function's parameter schema as llguidance JSON (an object schema
with properties and no `additionalProperties` allows no others, like OpenAI's strict mode; a function
without `parameters` takes none, as OpenAI defines it). XML parameters come in the schema's order,
required ones always, each value typed by its schema: a value whose schema allows no string is the
JSON text of that schema (numbers with their bounds, booleans, objects, arrays), enums are one of their
values, anything with a string type is raw text up to the closing tag (a string's minLength and
maxLength are enforced there, in characters; its pattern and format are not). Python keyword
arguments likewise, in order, with JSON text for strings, numbers, lists and dicts (all valid Python
literals) and True / False / None for booleans and null (inside a list or dict those stay JSON's).

It must not know about requests; the input processor compiles the OutputConstraint like any other, and the
output parser streams the calls from the same CallSyntax.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from foveal.parsing.tool_formats.base import CallSyntax, valid_name
from foveal.parsing.tool_formats.values import schema_types
from foveal.parsing.tools import get_format
from foveal.structured.constraint import OutputConstraint

_NONE = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters
# a raw XML value ends at the first "\n</parameter>" (a lazy rule) and may not hold the other lines that
# end a value for the format's parser ("\n<parameter=", "\n</function>"): a model that has not learnt
# the format then closes the parameter instead of writing on
_MARKUP_INSIDE = r"/(.|\n)*\n(<parameter=|<\/function>)(.|\n)*/"


@dataclass(frozen=True, slots=True)
class ToolConstraint:
    grammar: OutputConstraint
    syntax: CallSyntax  # how the output parser streams the calls the grammar writes


class _Lark:
    """Lark text for one request: literals (special tokens as `<[id]>`) and numbered rules."""

    def __init__(self, special: Mapping[str, int]):
        self.special = special
        self.split = re.compile("(" + "|".join(map(re.escape, sorted(special, key=len, reverse=True))) + ")")
        self.rules: list[str] = []

    def lit(self, text: str) -> str:
        parts = self.split.split(text) if self.special else [text]
        out = [f"<[{self.special[p]}]>" if p in self.special else json.dumps(p) for p in parts if p]
        return " ".join(out) if out else '""'

    def terminal(self, body: str) -> str:
        """A named lexeme (one per distinct body)."""
        for line in self.rules:
            name, _, rest = line.partition(": ")
            if name.isupper() and rest == body:
                return name
        name = f"T{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"r{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name


def _json_args(fn: Mapping[str, Any]) -> str:
    params = dict(fn.get("parameters") or _NONE)
    if params.get("type") == "object" and "properties" in params:
        params.setdefault("additionalProperties", False)
    return "%json " + json.dumps(params, ensure_ascii=False)


def _xml_value(lark: _Lark, schema: Any) -> str:
    """One parameter's value and the end of its element (`\\n</parameter>\\n`)."""
    end = lark.lit("\n</parameter>\n")
    schema = schema if isinstance(schema, dict) else {}
    if "enum" in schema or "const" in schema:
        values = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
        texts = {v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values}
        if texts and all("\n</parameter>" not in t for t in texts):
            return "(" + " | ".join(lark.lit(t) for t in sorted(texts)) + ") " + end
    types = schema_types(schema)
    if not types or "string" in types:
        low, high = schema.get("minLength"), schema.get("maxLength")
        count = "*"
        if types == ["string"] and (isinstance(low, int) or isinstance(high, int)):
            count = f"{{{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}}}"
        text = lark.terminal(f"/(.|\\n){count}/ & ~{_MARKUP_INSIDE}")
        return lark.rule(f'{text} "\\n</parameter>"', lazy=True) + " " + lark.lit("\n")
    # no string among the types: the value's raw text is its JSON text (numbers with their bounds)
    return "%json " + json.dumps(schema, ensure_ascii=False) + " " + end


def _xml_args(lark: _Lark, fn: Mapping[str, Any]) -> str:
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else _NONE
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if props is None and params.get("additionalProperties") is not False:  # any names, untyped values
        return f'("<parameter=" /[A-Za-z0-9_.:\\-]+/ ">\\n" {_xml_value(lark, {})})*'
    required = set(params.get("required") or ())
    out = []
    for name, schema in props.items():
        if not valid_name(name):
            raise ValueError(f"parameter {name!r} of {fn['name']!r} cannot be written as a Qwen XML tag")
        element = f"{lark.lit(f'<parameter={name}>' + chr(10))} {_xml_value(lark, schema)}"
        out.append(element if name in required else f"({element})?")
    return " ".join(out) or '""'


def _py_value(lark: _Lark, schema: Any) -> str:
    """One keyword argument's value as a Python literal: JSON text for strings, numbers, lists and
    dicts (valid Python), True / False / None for booleans and null."""
    schema = schema if isinstance(schema, dict) else {}
    if "enum" in schema or "const" in schema:
        values = list(schema.get("enum") or []) + ([schema["const"]] if "const" in schema else [])
        return "(" + " | ".join(sorted({lark.lit(_py_literal(v)) for v in values})) + ")"
    types = schema_types(schema)
    alts = [
        lark.lit(x)
        for t, xs in (("boolean", ("True", "False")), ("null", ("None",)))
        if t in types
        for x in xs
    ]
    rest = [t for t in types if t not in ("boolean", "null")]
    if rest or not types:
        sub = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "type")} if types else schema
        alts.append("%json " + json.dumps({**sub, "type": rest} if types else sub, ensure_ascii=False))
    return "(" + " | ".join(alts) + ")"


def _py_literal(v: Any) -> str:
    if v is None or isinstance(v, bool):
        return {None: "None", True: "True", False: "False"}[v]
    return json.dumps(v, ensure_ascii=False)


def _py_args(lark: _Lark, fn: Mapping[str, Any]) -> str:
    """`k=v, k=v` in the schema's order, required ones always; a comma only between arguments."""
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else _NONE
    props = params.get("properties") if isinstance(params.get("properties"), dict) else None
    if props is None and params.get("additionalProperties") is not False:  # any names, any JSON values
        kv = lark.rule('/[A-Za-z_][A-Za-z0-9_]*/ "=" %json {}')
        return f'({kv} (", " {kv})*)?'
    required = set(params.get("required") or ())
    after = first = ""  # rules: the rest once an argument was written / while none has been
    for name, schema in reversed(list((props or {}).items())):
        if not name.isidentifier():
            raise ValueError(f"parameter {name!r} of {fn['name']!r} cannot be a Python keyword argument")
        kv = lark.rule(f"{lark.lit(name + '=')} {_py_value(lark, schema)}")
        more = f'", " {kv} {after}'.strip() if name in required else f'(", " {kv})? {after}'.strip()
        now = f"{kv} {after}".strip()
        first = lark.rule(now if name in required else f"({now}" + (f" | {first})" if first else ")?"))
        after = lark.rule(more)
    return first


def tool_call_grammar(
    fmt: str,
    tools: Sequence[Mapping[str, Any]],
    choice: str | Mapping[str, Any],
    parallel: bool = True,
    special: Mapping[str, int] | None = None,
) -> ToolConstraint | None:
    """The constraint on a request's output for `choice` ("auto", "required" or {"type": "function",
    "function": {"name": ...}}), or None when nothing is constrained. `special`: the format's markers
    that are special tokens of the tokenizer, text -> id. ValueError when a required or named choice
    cannot be enforced for this format, or names a tool that was not offered."""
    special = dict(special or {})
    functions = [t["function"] for t in tools]
    if isinstance(choice, Mapping):
        name = choice["function"]["name"]
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        parallel, mode = False, "required"
    else:
        mode = choice
    if mode == "none" or not functions:
        return None
    syntax = get_format(fmt).call_syntax(frozenset(special))
    if syntax is None or (mode == "auto" and syntax.trigger is None and syntax.start is None):
        if mode == "auto":
            return None
        raise ValueError(f"tool_choice {mode!r} cannot be enforced for the {fmt} tool-call format")
    for fn in functions:
        if not valid_name(fn["name"]):
            raise ValueError(
                f"function name {fn['name']!r}: a constrained call needs letters, digits and _ . : - only"
            )
    lark = _Lark(special)
    text_trigger = mode == "auto" and syntax.trigger is not None and syntax.trigger not in special
    if text_trigger and not syntax.head("f").startswith(syntax.trigger):
        raise ValueError(f"the {fmt} trigger does not start its call")  # a format defined wrongly

    def call(fn: Mapping[str, Any], skip: int = 0, before: str = "") -> str:
        build = {"xml": _xml_args, "python": _py_args}.get(syntax.args_kind)
        args = build(lark, fn) if build else _json_args(fn)
        return _seq(lark, (before + syntax.head(fn["name"]))[skip:], args, syntax.tail)

    if text_trigger:  # a section is one call; its opener ends the free text before it
        rest = lark.rule(" | ".join(call(fn, len(syntax.trigger)) for fn in functions))
        trig = lark.rule(f"TEXT {lark.lit(syntax.trigger)}", lazy=True)
        start = f"start: ({trig} {rest}){'*' if parallel else '?'} TEXT"
    else:
        # the section's opening text and the first head make one literal: a free-text lexeme alive
        # beside a shorter one would otherwise outlive it
        first = lark.rule(" | ".join(call(fn, before=syntax.open) for fn in functions))
        if parallel and syntax.sep is not None:
            one = lark.rule(" | ".join(call(fn) for fn in functions))
            first = f"{first} ({lark.lit(syntax.sep)} {one})*"
        section = lark.rule(_seq(lark, "", first, syntax.close))
        if mode == "auto" and syntax.trigger is None:  # a call opens the output, or it is free text
            start = f"start: {section} | FREE"
            lark.rules.append(f"FREE: /(.|\\n)*/ & ~/{syntax.start}(.|\\n)*/")
        elif mode == "auto":  # the trigger is a special token: text cannot contain it
            start = f"start: TEXT ({section} TEXT){'*' if parallel else '?'}"
        elif parallel and syntax.between is not None:
            start = f"start: {section} ({_seq(lark, syntax.between, section, '')})*"
        else:
            start = f"start: {section}"
    lines = ["%llguidance {}", start, *lark.rules]
    if "TEXT" in start:
        lines.append("TEXT: /(.|\\n)*/")
    return ToolConstraint(OutputConstraint.lark("\n".join(lines)), syntax)


def _opt(lark: _Lark, text: str) -> str:
    return lark.lit(text) if text else ""


def _seq(lark: _Lark, before: str, body: str, after: str) -> str:
    """Literal text, a rule body, literal text (empty literals left out)."""
    return " ".join(x for x in (_opt(lark, before), body, _opt(lark, after)) if x)
