"""Tool calls as grammars (llguidance's Lark): a tool-call format's call syntax around each offered
function's parameter schema, so a call's arguments always parse and validate.

    tool_choice "required"    calls only: one, or several separated as the format does (parallel)
    tool_choice {function}    that one function's call only
    tool_choice "auto"        free text; where the text reaches the format's trigger ("<tool_call>"),
                              a lazy lexeme ends the text and the call that follows is constrained

Formats with a builder: hermes (Qwen 2.5/3, Hermes, and the generic tool prompt of templates without
tool support) and llama3_json. For another format, "required" and a named choice are refused (they
would not be enforced), and "auto" stays free text (its calls are still parsed). It must not know
about requests; the input processor compiles what it returns like any other GrammarSpec.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from foveal.structured.spec import GrammarSpec

_ANY = {"type": "object"}


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal takes JSON's escapes


def _schema(fn: Mapping[str, Any]) -> str:
    """The arguments' schema; an object schema that does not say otherwise takes no properties beyond
    its own (a call names the parameters the function declares, as OpenAI's strict mode)."""
    params = dict(fn.get("parameters") or _ANY)
    if params.get("type") == "object" and "properties" in params:
        params.setdefault("additionalProperties", False)
    return "%json " + json.dumps(params, ensure_ascii=False)


def _hermes(fn: Mapping[str, Any]) -> tuple[str, str]:
    """(the text before the arguments, the text after them)."""
    return '<tool_call>\n{"name": ' + json.dumps(
        fn["name"], ensure_ascii=False
    ) + ', "arguments": ', "}\n</tool_call>"


def _llama3(fn: Mapping[str, Any]) -> tuple[str, str]:
    return '{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "parameters": ', "}"


# format -> (a function's call around its arguments, the separator of parallel calls, the trigger)
_BUILDERS = {
    "hermes": (_hermes, "\n", "<tool_call>"),
    "llama3_json": (_llama3, None, None),
}


def _call(fn: Mapping[str, Any], around, skip: int = 0) -> str:
    """One call as a Lark expansion; `skip` characters of its opening text left out (the trigger)."""
    head, tail = around(fn)
    head = head[skip:]
    return f"{_lit(head) if head else ''} {_schema(fn)} {_lit(tail)}".strip()


def supports(fmt: str) -> bool:
    return fmt in _BUILDERS


def tool_call_grammar(
    fmt: str, tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], parallel: bool = True
) -> GrammarSpec | None:
    """The grammar of a request's output for `choice` ("auto", "required" or {"type": "function",
    "function": {"name": ...}}), or None when nothing is constrained. ValueError when a required or
    named choice cannot be enforced for this format, or names a tool that was not offered."""
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
    build = _BUILDERS.get(fmt)
    if build is None:
        if mode == "auto":
            return None
        raise ValueError(f"tool_choice {mode!r} cannot be enforced for the {fmt} tool-call format")
    around, sep, trigger = build
    rules = [f"call_{i}: {_call(fn, around)}" for i, fn in enumerate(functions)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    if mode == "required":
        many = f"({_lit(sep)} call)*" if parallel and sep else ""
        return GrammarSpec.lark("\n".join([f"start: call {many}".rstrip(), call, *rules]))
    if trigger is None:  # auto: a format without a trigger (a bare JSON call) stays free text
        return None
    # auto: text, then any number of (trigger, the rest of a call, text); the lazy lexeme ends the text
    # at the first trigger, so the free text never contains one
    rest = [f"rest_{i}: {_call(fn, around, len(trigger))}" for i, fn in enumerate(functions)]
    lines = [
        "%llguidance {}",
        "start: seg* tail",
        "seg: trig (" + " | ".join(f"rest_{i}" for i in range(len(functions))) + ")",
        f"trig[lazy]: TEXT {_lit(trigger)}",
        "tail: TEXT",
        "TEXT: /(.|\\n)*/",
        *rest,
    ]
    return GrammarSpec.lark("\n".join(lines))
