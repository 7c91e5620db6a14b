"""DeepSeek V3.2 / V4 / V4.1 tool calls in DSML, an XML-like markup with the `｜DSML｜` token:

    <｜DSML｜function_calls>                  (V4: tool_calls; V4.1: `<｜DSML｜ calls>`, a space in every tag)
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

`string="true"` values are raw text (no escaping), `string="false"` values are JSON (typed by the
tool's schema if they are not valid JSON). A self-closing `<｜DSML｜invoke name="x"/>` is a call without
arguments. Each call is sent at its `</｜DSML｜invoke>`.
"""

from __future__ import annotations

import re

from foveal.parsing.tool_formats.base import (
    DONE,
    RunScanner,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    dump_arguments,
    load_json,
    skip_ws,
    valid_name,
)
from foveal.parsing.tool_formats.values import coerce

DSML = "｜DSML｜"
OPENERS = (f"<{DSML}function_calls>", f"<{DSML}tool_calls>", f"<{DSML} calls>")
_BLOCKS = ("function_calls", "tool_calls", "calls")
_TAG = re.compile(r'<(/?)｜DSML｜ ?([A-Za-z_]+)((?:\s+[A-Za-z_]+="[^"]*")*)\s*(/?)>')
_ATTR = re.compile(r'([A-Za-z_]+)="([^"]*)"')
_END_PARAM = re.compile(r"</｜DSML｜ ?parameter>")
_MAX_TAG = 1024


class DsmlScanner(RunScanner):
    def __init__(self, opener: str, tools: ToolSchemas):
        self.tools = tools
        self.olen = len(opener)
        self.phase, self.pos = "block", self.olen
        self.name, self.param, self.raw_string = "", "", True
        self.args: dict = {}
        self.search = 0
        self.emitted, self.last_end = 0, 0

    def _tag(self, text: str, i: int):
        """The DSML tag at i: (closing, name, attrs, self_closing, end); None: not complete yet;
        False: something else is there."""
        if i >= len(text):
            return None
        j = text.find(">", i, i + _MAX_TAG)
        if j < 0:
            rest = text[i : i + 10]
            maybe = any(p.startswith(rest) or rest.startswith(p) for p in (f"<{DSML}", f"</{DSML}"))
            return None if maybe and len(text) - i < _MAX_TAG else False
        m = _TAG.fullmatch(text, i, j + 1)
        if m is None:
            return False
        closing, name, attrs, self_closing = m.groups()
        return bool(closing), name, dict(_ATTR.findall(attrs)), bool(self_closing), j + 1

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        while True:
            if self.phase == "value":
                m = _END_PARAM.search(text, self.search)
                if m is None:
                    self.search = max(self.search, len(text) - 20)  # a closing tag may have begun
                    return None
                self.args[self.param] = self._value(text[self.pos : m.start()])
                self.phase, self.pos = "invoke", m.end()
                continue
            tag = self._tag(text, skip_ws(text, self.pos))
            if not tag:
                return None if tag is None else self._give_up()
            closing, name, attrs, self_closing, end = tag
            if self.phase == "block":  # an invoke, or the end of the block
                if closing and name in _BLOCKS:
                    return Step(DONE, end)
                if closing or name != "invoke" or not valid_name(attrs.get("name", "")):
                    return self._give_up()
                self.name, self.args, self.pos = attrs["name"], {}, end
                if self_closing:
                    self._emit(calls, end)
                else:
                    self.phase = "invoke"
            else:  # invoke: a parameter, or the end of the invoke
                if closing and name == "invoke":
                    self._emit(calls, end)
                elif not closing and name == "parameter" and attrs.get("name") and not self_closing:
                    self.param, self.raw_string = attrs["name"], attrs.get("string", "true") != "false"
                    self.phase, self.pos = "value", end
                    self.search = end
                else:
                    return self._give_up()

    def _value(self, raw: str):
        if self.raw_string:
            return raw
        try:
            return load_json(raw)
        except ValueError:
            return coerce(raw, self.tools.property_schema(self.name, self.param), "json")

    def _emit(self, calls: list[tuple[str, str]], end: int) -> None:
        calls.append((self.name, dump_arguments(self.args)))
        self.emitted, self.last_end, self.pos, self.phase = self.emitted + 1, end, end, "block"


class DeepSeekDsml(ToolFormat):
    name = "deepseek_dsml"
    aliases = ("deepseek_v32", "deepseek_v3_2", "deepseek_v4", "deepseek_v41", "dsml")
    trim_separators = True
    markers = ToolMarkers(
        triggers=OPENERS,
        start_triggers=(),
        call_close=f"</{DSML}invoke>",
        args_open=None,
        body="dsml",
        markup=(*OPENERS, f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}parameter", f"</{DSML}parameter>"),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> DsmlScanner:
        return DsmlScanner(opener, tools)
