"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`; parallel calls are separated by `;`.

Without `<|python_tag|>` the object counts only at the start of the output (or right after a call),
and only if its first key is one a call has (`name`, `parameters`, `arguments`, `type`); any other
`{` there is content at once. An object without a string `name` and an object of arguments
(`parameters`, or `arguments` as Llama models also write) is content, unchanged. There is no closing
marker: the call is complete when its object closes.
"""

from __future__ import annotations

import json
import re

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
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"
_KEYS = ("name", "parameters", "arguments", "type")
_FIRST_KEY = re.compile(r'\{\s*"([a-z]*)("?)')


def _first_key_state(text: str, start: int) -> str:
    """ "yes" / "no" / "partial": does the object at `start` begin with a key a call can have?"""
    m = _FIRST_KEY.match(text, start)
    if m is None:  # `{` followed by whitespace only, or by something that is not a key
        return "partial" if text[start + 1 :].isspace() or start + 1 == len(text) else "no"
    key, closed = m.groups()
    if closed:
        return "yes" if key in _KEYS else "no"
    if m.end() < len(text):  # the key went on with a character no call key has
        return "no"
    return "partial" if any(k.startswith(key) for k in _KEYS) else "no"


class Llama3JsonScanner:
    def __init__(self, opener: str):
        self.olen = len(opener)  # `{` itself for a bare object: giving it back makes progress
        self.pos = len(opener) if opener == PYTHON_TAG else 0
        self.span: JsonSpan | None = None
        self.start = 0
        self.key_ok = False
        self.emitted, self.last_end = 0, 0

    def _give_up(self) -> Step:
        # calls already sent stay sent; what follows the last one is content
        return Step(DONE, self.last_end) if self.emitted else Step(NOT_CALL, self.olen)

    def advance(self, text: str, final: bool) -> Step:
        calls: list[tuple[str, str]] = []
        step = self._run(text, final, calls)
        step.calls = calls
        return step

    def _run(self, text: str, final: bool, calls: list[tuple[str, str]]) -> Step:
        while True:
            if self.span is None:
                i = skip_ws(text, self.pos)
                if self.emitted:  # after a call: `;` and the next object, or the end of the calls
                    if i < len(text) and text[i] != ";":
                        return Step(DONE, self.last_end)
                    i = skip_ws(text, i + 1)
                if i >= len(text):
                    return self._give_up() if final else Step(MORE)
                if text[i] != "{":
                    return self._give_up()
                self.start, self.span, self.key_ok = i, JsonSpan(i), False
            if not self.key_ok:
                state = _first_key_state(text, self.start)
                if state == "no" or (state == "partial" and final):
                    return self._give_up()
                if state == "partial":
                    return Step(MORE)
                self.key_ok = True
            end = self.span.advance(text)
            if end is None:
                return self._give_up() if final else Step(MORE)
            try:
                call = call_from_object(load_json(text[self.start : end]), require_args=True)
            except ValueError:
                call = None
            if call is None:
                return self._give_up()
            calls.append(call)
            self.emitted += 1
            self.last_end = self.pos = end
            self.span = None


class Llama3Json(ToolFormat):
    name = "llama3_json"
    aliases = ("llama3", "llama", "llama31", "llama32", "llama33")
    markers = ToolMarkers(
        triggers=(PYTHON_TAG,),
        start_triggers=("{",),
        call_close=None,
        args_open=None,
        body="json_name_parameters",
        markup=(PYTHON_TAG, "<|eom_id|>", "<|eot_id|>"),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> Llama3JsonScanner:
        return Llama3JsonScanner(opener)

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax:
        # one call (the Llama 3.1 templates take no parallel calls), a bare object opening the output
        return CallSyntax(
            head=lambda name: '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": ',
            tail="}",
            start=r'\s*\{\s*"name"',
        )
