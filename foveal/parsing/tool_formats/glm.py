"""GLM-4.5 / 4.6 / 4.7 / 5.x tool calls:

    <tool_call>NAME
    <arg_key>K</arg_key>
    <arg_value>V</arg_value>
    </tool_call>

GLM-4.5/4.6 put newlines between the name, keys and values; 4.7 and later write them with none. Both
are accepted. A value is everything up to `</arg_value>` (no escaping, whitespace is data). String
values are raw and other values are JSON (`tojson`), so the tool's schema decides (`values.coerce`);
without a schema a value that parses as JSON is JSON. The call is complete at `</tool_call>`; a
natural stop right after a complete value closes it too.
"""

from __future__ import annotations

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    MORE,
    NOT_CALL,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    dump_arguments,
    prefix_state,
    skip_ws,
    valid_name,
)
from foveal.parsing.tool_formats.values import coerce

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, END_KEY, VALUE, END_VALUE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GlmScanner:
    def __init__(self, opener: str, tools: ToolSchemas):
        self.tools = tools
        self.olen = len(opener)
        self.phase, self.pos = "name", self.olen
        self.name, self.key = "", ""
        self.args: dict[str, str] = {}
        self.search = 0  # where to look for </arg_value> next

    def advance(self, text: str, final: bool) -> Step:
        step = self._run(text)
        if step is not None:
            return step
        if not final:
            return Step(MORE)
        if self.phase == "body":  # stopped after a complete value: the stop closes the call
            return Step(DONE, len(text), [self._call()])
        return Step(NOT_CALL, self.olen)

    def _run(self, text: str) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "name":  # up to a newline, the first <arg_key> or </tool_call>
                ends = [
                    k for m in ("\n", KEY, CLOSE) if (k := text.find(m, self.pos, self.pos + MAX_NAME)) >= 0
                ]
                if not ends:
                    return Step(NOT_CALL, self.olen) if n - self.pos >= MAX_NAME else None
                name = text[self.pos : min(ends)].strip()
                if not valid_name(name):
                    return Step(NOT_CALL, self.olen)
                self.name, self.phase, self.pos = name, "body", min(ends)
            elif self.phase == "body":  # whitespace, then <arg_key> or </tool_call>
                i = skip_ws(text, self.pos)
                states = (prefix_state(text, i, KEY), prefix_state(text, i, CLOSE))
                if states[0] == "yes":
                    self.phase, self.pos = "key", i + len(KEY)
                elif states[1] == "yes":
                    return Step(DONE, i + len(CLOSE), [self._call()])
                else:
                    return None if "partial" in states else Step(NOT_CALL, self.olen)
            elif self.phase == "key":
                k = text.find(END_KEY, self.pos, self.pos + MAX_NAME + len(END_KEY))
                if k < 0:
                    return Step(NOT_CALL, self.olen) if n - self.pos >= MAX_NAME + len(END_KEY) else None
                self.key = text[self.pos : k].strip()
                if not self.key:
                    return Step(NOT_CALL, self.olen)
                i = skip_ws(text, k + len(END_KEY))
                state = prefix_state(text, i, VALUE)
                if state != "yes":
                    return None if state == "partial" else Step(NOT_CALL, self.olen)
                self.phase, self.pos = "value", i + len(VALUE)
                self.search = self.pos
            else:  # value
                k = text.find(END_VALUE, self.search)
                if k < 0:
                    self.search = max(self.search, n - len(END_VALUE) + 1)
                    return None
                self.args[self.key] = text[self.pos : k]
                self.phase, self.pos = "body", k + len(END_VALUE)

    def _call(self) -> tuple[str, str]:
        args = {k: coerce(v, self.tools.property_schema(self.name, k), "json") for k, v in self.args.items()}
        return self.name, dump_arguments(args)


class Glm(ToolFormat):
    name = "glm"
    aliases = ("glm45", "glm47", "glm4_moe", "glm5")
    trim_separators = True
    markers = ToolMarkers(
        triggers=(OPEN,),
        start_triggers=(),
        call_close=CLOSE,
        args_open=KEY,
        body="glm_arg_pairs",
        markup=(OPEN, CLOSE, KEY, END_KEY, VALUE, END_VALUE),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> GlmScanner:
        return GlmScanner(opener, tools)
