"""Kimi K2 tool calls: a section of calls, each named by its id `functions.NAME:INDEX`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The name is the id without `functions.` and `:INDEX` (ids without the prefix are accepted). Text
inside the section but outside a call is markup noise and dropped; text after the section is
content. Each call is sent at its `<|tool_call_end|>`. (Kimi K3's XTML is another format, not this.)
"""

from __future__ import annotations

import re

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    MORE,
    NOT_ARGS,
    NOT_CALL,
    JsonSpan,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    dump_arguments,
    prefix_state,
    read_json_args,
    skip_ws,
    valid_name,
)

SECTION, END_SECTION = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL, ARG, END_CALL = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


class KimiK2Scanner:
    def __init__(self, opener: str):
        self.olen = len(opener)
        self.phase, self.pos = "section", self.olen
        self.name = ""
        self.span: JsonSpan | None = None
        self.start = 0
        self.emitted = 0

    def advance(self, text: str, final: bool) -> Step:
        calls: list[tuple[str, str]] = []
        step = self._run(text, calls)
        if step is None:
            if not final:
                step = Step(MORE)
            else:  # a section the model never closed ends with the output if it held calls
                step = Step(DONE, len(text)) if self.emitted else Step(NOT_CALL, self.olen)
        step.calls = calls
        return step

    def _give_up(self) -> Step:
        # a broken call: the section so far is markup when calls were sent, else all of it is text
        return Step(DONE, self.pos) if self.emitted else Step(NOT_CALL, self.olen)

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "section":  # noise up to the next call or the end of the section
                c, e = text.find(CALL, self.pos), text.find(END_SECTION, self.pos)
                if e >= 0 and (c < 0 or e < c):
                    return Step(DONE, e + len(END_SECTION))
                if c < 0:  # noise: look again only where a marker may still begin
                    self.pos = max(self.pos, n - len(END_SECTION) + 1)
                    return None
                self.phase, self.pos = "id", c + len(CALL)
            elif self.phase == "id":
                k = text.find(ARG, self.pos, self.pos + MAX_NAME + len(ARG))
                if k < 0:
                    return self._give_up() if n - self.pos >= MAX_NAME + len(ARG) else None
                name = _ID.fullmatch(text[self.pos : k].strip())
                if name is None or not valid_name(name.group(1)):
                    return self._give_up()
                self.name, self.phase, self.pos = name.group(1), "args", k + len(ARG)
            elif self.phase == "args":
                args = read_json_args(self, text)
                if args is None:
                    return None
                if args is NOT_ARGS:
                    return self._give_up()
                self.args, self.phase = args, "end"
            else:  # end: whitespace, then <|tool_call_end|>
                i = skip_ws(text, self.pos)
                state = prefix_state(text, i, END_CALL)
                if state != "yes":
                    return None if state == "partial" else self._give_up()
                calls.append((self.name, dump_arguments(self.args)))
                self.emitted += 1
                self.phase, self.pos = "section", i + len(END_CALL)


class KimiK2(ToolFormat):
    name = "kimi_k2"
    aliases = ("kimi", "kimi_k2_instruct", "kimi_k2_thinking")
    markers = ToolMarkers(
        triggers=(SECTION,),
        start_triggers=(),
        call_close=END_CALL,
        args_open=ARG,
        body="kimi_k2",
        markup=(SECTION, END_SECTION, CALL, ARG, END_CALL),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> KimiK2Scanner:
        return KimiK2Scanner(opener)
