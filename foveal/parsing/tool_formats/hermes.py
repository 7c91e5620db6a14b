"""Hermes / Qwen 2.5 / Qwen3 tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.

One JSON object per block; blocks for parallel calls follow each other (the template puts a newline
between them and before the first). The block ends at `</tool_call>` outside the JSON's strings, so a
marker written inside an argument string does not end it. Accepted leniently: `"parameters"` for
`"arguments"`, arguments double-encoded as a JSON string, a missing `"arguments"` (= `{}`), and a
missing `</tool_call>` when the model stopped right after the object.
"""

from __future__ import annotations

import json

from foveal.parsing.tool_formats.base import (
    DONE,
    MORE,
    NOT_CALL,
    CallSyntax,
    JsonSpan,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    call_from_object,
    load_json,
    prefix_state,
    skip_ws,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesScanner:
    def __init__(self, opener: str):
        self.olen = len(opener)
        self.span: JsonSpan | None = None
        self.body_start = self.body_end = -1
        self.call: tuple[str, str] | None = None

    def advance(self, text: str, final: bool) -> Step:
        if self.span is None:
            i = skip_ws(text, self.olen)
            if i == len(text):
                return Step(NOT_CALL, self.olen) if final else Step(MORE)
            if text[i] != "{":
                return Step(NOT_CALL, self.olen)
            self.body_start, self.span = i, JsonSpan(i)
        if self.call is None:
            end = self.span.advance(text)
            if end is None:
                return Step(NOT_CALL, self.olen) if final else Step(MORE)
            try:
                self.call = call_from_object(load_json(text[self.body_start : end]))
            except ValueError:
                self.call = None
            if self.call is None:
                return Step(NOT_CALL, self.olen)
            self.body_end = end
        j = skip_ws(text, self.body_end)
        state = prefix_state(text, j, CLOSE)
        if state == "yes":
            return Step(DONE, j + len(CLOSE), [self.call])
        if state == "partial":  # the closer is still coming, or the model stopped after the object
            return Step(DONE, len(text), [self.call]) if final else Step(MORE)
        return Step(NOT_CALL, self.olen)


class Hermes(ToolFormat):
    name = "hermes"
    aliases = ("qwen", "qwen25", "qwen3", "qwen3_json", "hermes2", "hermes3")
    trim_separators = True
    markers = ToolMarkers(
        triggers=(OPEN,),
        start_triggers=(),
        call_close=CLOSE,
        args_open=None,
        body="json_name_arguments",
        markup=(OPEN, CLOSE),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> HermesScanner:
        return HermesScanner(opener)

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax:
        return CallSyntax(
            head=lambda name: OPEN + '\n{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
            tail="}\n" + CLOSE,
            between="\n",
            trigger=OPEN,
        )
