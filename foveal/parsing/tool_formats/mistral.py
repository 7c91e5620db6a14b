"""Mistral tool calls after the `[TOOL_CALLS]` control token, in the tokenizer versions' two shapes:

    v3 (Mistral 7B v0.3 ...)    [TOOL_CALLS] [{"name": "f", "arguments": {...}}, {...}]
    v11 and later (v13, ...)    [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}
                                [TOOL_CALLS]f[CALL_ID]123456789[ARGS]{...}   (ids are dropped)

There is no closing marker: a call is complete when its JSON closes. Each element of a v3 list is
sent as soon as it closes, so a list cut short keeps its complete calls. `[THINK]...[/THINK]` is the
reasoning parser's business.
"""

from __future__ import annotations

import json
import re

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    CallSyntax,
    JsonSpan,
    RunScanner,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    arguments_object,
    call_from_object,
    dump_arguments,
    load_json,
    prefix_state,
    skip_ws,
    valid_name,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:\-]*")
_ID_CHARS = re.compile(r"[A-Za-z0-9_\-]*")


class MistralScanner(RunScanner):
    def __init__(self, opener: str):
        self.olen = len(opener)
        self.phase, self.pos = "start", self.olen
        self.name = ""
        self.span: JsonSpan | None = None
        self.start = 0
        self.emitted, self.last_end = 0, 0

    def _json(self, text: str) -> object | None:
        """The JSON value of the open span once it closes; None while open; ValueError if invalid."""
        end = self.span.advance(text)
        if end is None:
            return None
        self.pos, self.span = end, None
        return load_json(text[self.start : end])

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "start":
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == "[":
                    self.phase, self.pos = "element", i + 1
                elif text[i] == "{":  # a v3 call without the list brackets
                    self.phase, self.pos = "single", i
                else:
                    self.phase, self.pos = "name", i
            elif self.phase == "name":
                end = _NAME_CHARS.match(text, self.pos).end()
                if end - self.pos > MAX_NAME:
                    return self._give_up()
                if end == n:
                    return None
                self.name = text[self.pos : end]
                if not valid_name(self.name):
                    return self._give_up()
                states = (prefix_state(text, end, ARGS), prefix_state(text, end, CALL_ID))
                if states[0] == "yes":
                    self.phase, self.pos = "args", end + len(ARGS)
                elif states[1] == "yes":
                    self.phase, self.pos = "call_id", end + len(CALL_ID)
                elif text[end] == "{":  # name{json}: no [ARGS]
                    self.phase, self.pos = "args", end
                else:
                    return None if "partial" in states else self._give_up()
            elif self.phase == "call_id":
                end = _ID_CHARS.match(text, self.pos).end()
                state = prefix_state(text, end, ARGS)
                if end - self.pos > MAX_NAME or state == "no":
                    return self._give_up()
                if state == "partial":
                    return None
                self.phase, self.pos = "args", end + len(ARGS)
            elif self.phase in ("args", "single", "element"):
                if self.span is None:
                    i = skip_ws(text, self.pos)
                    if i == n:
                        return None
                    if text[i] != "{":
                        return self._give_up()
                    self.start, self.span = i, JsonSpan(i)
                try:
                    value = self._json(text)
                except ValueError:
                    return self._give_up()
                if value is None:
                    return None
                if self.phase == "args":
                    args = arguments_object(value)
                    call = None if args is None else (self.name, dump_arguments(args))
                else:
                    call = call_from_object(value)
                if call is None:
                    return self._give_up()
                calls.append(call)
                self.emitted, self.last_end = self.emitted + 1, self.pos
                if self.phase != "element":
                    return Step(DONE, self.pos)
                self.phase = "list_sep"
            else:  # list_sep: `,` and the next element, or `]`
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == "]":
                    return Step(DONE, i + 1)
                if text[i] != ",":
                    return self._give_up()
                self.phase, self.pos = "element", i + 1


class Mistral(ToolFormat):
    name = "mistral"
    aliases = ("mistral_v3", "mistral_v11", "mistral_v13", "magistral", "devstral")
    markers = ToolMarkers(
        triggers=(TOOL_CALLS,),
        start_triggers=(),
        call_close=None,
        args_open=ARGS,
        body="mistral",
        markup=(TOOL_CALLS, ARGS, CALL_ID),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> MistralScanner:
        return MistralScanner(opener)

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax:
        if ARGS in special:  # v11+: the tokenizer has [ARGS]
            return CallSyntax(
                head=lambda name: TOOL_CALLS + name + ARGS, tail="", between="", trigger=TOOL_CALLS
            )
        return CallSyntax(  # v3: one list of call objects
            head=lambda name: '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ',
            tail="}",
            open=TOOL_CALLS + "[",
            sep=", ",
            close="]",
            trigger=TOOL_CALLS,
        )
