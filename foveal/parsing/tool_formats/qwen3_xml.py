"""Qwen3-Coder / Qwen3.5+ XML tool calls, values typed by the tool's parameter schema:

    <tool_call>
    <function=NAME>
    <parameter=P>
    VALUE
    </parameter>
    </function>
    </tool_call>

Values are raw text (no escaping). In the template's layout exactly one newline on each side of a
value is markup, so a value ends at `\\n</parameter>` (or `\\n<parameter=` / `\\n</function>` when the
model forgot `</parameter>`); a `</parameter>` inside a line is part of the value. A value written
without the leading newline (`<parameter=p>5</parameter>`) ends at the first `</parameter>`.
Accepted leniently: a bare `<function=...>` without `<tool_call>`, a missing `</function>` before
`</tool_call>`, and a natural stop right after a complete parameter. The call is complete at
`</function>`; the `</tool_call>` after it is skipped.

Values are typed by the tool's schema (`values.coerce`); for an unknown tool or parameter JSON
object/array text is decoded and the rest stays a string.
"""

from __future__ import annotations

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    MORE,
    NOT_CALL,
    CallSyntax,
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
FUNC, END_FUNC = "<function=", "</function>"
PARAM, END_PARAM = "<parameter=", "</parameter>"
_NL_DELIMS = ("\n" + END_PARAM, "\n" + PARAM, "\n" + END_FUNC)
_DELIMS = (END_PARAM, PARAM, END_FUNC)
_MAX_DELIM = max(map(len, _NL_DELIMS))


class QwenXmlScanner:
    def __init__(self, opener: str, tools: ToolSchemas):
        self.tools = tools
        self.olen = len(opener)
        self.phase = "func" if opener == OPEN else "name"
        self.pos = self.olen
        self.name = ""
        self.params: dict[str, str] = {}
        self.pname = ""
        self.newline = None  # value layout: True "\nVALUE\n</parameter>", False "VALUE</parameter>"
        self.vstart = self.search = 0

    def advance(self, text: str, final: bool) -> Step:
        step = self._run(text)
        if step is not None:
            return step
        if not final:
            return Step(MORE)
        if self.phase == "body":  # the model stopped between parameters: the stop closes the call
            return Step(DONE, len(text), [self._call()])
        return Step(NOT_CALL, self.olen)

    def _run(self, text: str) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "func":
                i = skip_ws(text, self.pos)
                state = prefix_state(text, i, FUNC)
                if state != "yes":
                    return None if state == "partial" else Step(NOT_CALL, self.olen)
                self.pos, self.phase = i + len(FUNC), "name"
            elif self.phase in ("name", "pname"):
                j = text.find(">", self.pos, self.pos + MAX_NAME + 1)
                if "\n" in text[self.pos : j if j >= 0 else n]:  # a name is one line
                    return Step(NOT_CALL, self.olen)
                if j < 0:
                    return Step(NOT_CALL, self.olen) if n - self.pos > MAX_NAME else None
                name = text[self.pos : j].strip()
                if self.phase == "name":
                    if not valid_name(name):
                        return Step(NOT_CALL, self.olen)
                    self.name, self.phase = name, "body"
                else:
                    if not name:
                        return Step(NOT_CALL, self.olen)
                    self.pname, self.phase, self.newline = name, "value", None
                self.pos = j + 1
            elif self.phase == "body":  # between parameters: whitespace, then the next tag
                i = skip_ws(text, self.pos)
                states = [prefix_state(text, i, lit) for lit in (PARAM, END_FUNC, CLOSE)]
                if states[0] == "yes":
                    self.pos, self.phase = i + len(PARAM), "pname"
                elif states[1] == "yes":
                    return Step(DONE, i + len(END_FUNC), [self._call()], closer=CLOSE)
                elif states[2] == "yes":  # </function> forgotten
                    return Step(DONE, i + len(CLOSE), [self._call()])
                else:
                    return None if "partial" in states else Step(NOT_CALL, self.olen)
            else:  # value
                if self.newline is None:
                    if self.pos >= n:
                        return None
                    self.newline = text[self.pos] == "\n"
                    self.vstart = self.pos + (1 if self.newline else 0)
                    self.search = self.pos
                delims = _NL_DELIMS if self.newline else _DELIMS
                hits = [(k, d) for d in delims if (k := text.find(d, self.search)) >= 0]
                if not hits:
                    self.search = max(self.search, n - _MAX_DELIM + 1)
                    return None
                k, d = min(hits)
                self.params[self.pname] = text[self.vstart : k] if k >= self.vstart else ""
                self.pos = k + len(d)
                if d.endswith(END_FUNC):
                    return Step(DONE, self.pos, [self._call()], closer=CLOSE)
                self.phase = "pname" if d.endswith(PARAM) else "body"

    def _call(self) -> tuple[str, str]:
        args = {p: coerce(v, self.tools.property_schema(self.name, p)) for p, v in self.params.items()}
        return self.name, dump_arguments(args)


class QwenXml(ToolFormat):
    name = "qwen3_xml"
    aliases = ("qwen3_coder", "qwen3coder", "qwen35", "qwen3_5")
    trim_separators = True
    markers = ToolMarkers(
        triggers=(OPEN, FUNC),
        start_triggers=(),
        call_close=CLOSE,
        args_open=None,
        body="xml_function",
        markup=(OPEN, CLOSE, FUNC, END_FUNC, PARAM, END_PARAM),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> QwenXmlScanner:
        return QwenXmlScanner(opener, tools)

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax:
        # the template's layout: each value between newlines, each element on its own lines
        return CallSyntax(
            head=lambda name: f"{OPEN}\n{FUNC}{name}>\n",
            tail=f"{END_FUNC}\n{CLOSE}",
            args_kind="xml",
            between="\n",
            trigger=OPEN,
        )
