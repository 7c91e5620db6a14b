"""Calls whose text a tool-call grammar wrote (`CallSyntax`), scanned as they grow.

A grammar fixes the layout to the character (`foveal.structured.tool_grammar` builds it from the same
`CallSyntax`), so there is nothing to guess: a call is `Opened` the moment its head (which holds the
name) is complete, its arguments go out as `Fragment`s as they arrive, and `Closed` carries their whole
text, which is what the fragments join to. JSON arguments are streamed as the model writes them (the
grammar makes them a valid object of the function's schema); XML parameters (`<parameter=p>` ...
`</parameter>`) are typed by the schema (`values.coerce`) and sent as JSON one parameter at a time:
`{"p": 1`, then `, "q": "x"`, then `}`; Python keyword arguments (`f(p=1, q="x")`) likewise.

Text that departs from the layout (only possible where no grammar applied) ends the scan: a call
not yet opened gives its opener back as content; one already opened is abandoned (its beginning was
sent; it is not among the complete calls).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable
from typing import Any

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    NOT_CALL,
    CallSyntax,
    Closed,
    Fragment,
    JsonSpan,
    Opened,
    Step,
    ToolSchemas,
    load_json,
    prefix_state,
    skip_ws,
)
from foveal.parsing.tool_formats.values import coerce

PARAM, VALUE_END = "<parameter=", "\n</parameter>\n"


class _Broken(Exception):
    """The text left the layout."""


class _JsonArgs:
    """A JSON object of arguments, sent as it arrives."""

    def __init__(self, pos: int):
        self.pos = self.sent = self.start = pos
        self.span: JsonSpan | None = None

    def advance(self, text: str, events: list) -> int | None:
        """Where the arguments end once they have, else None; fragments go to `events`."""
        if self.span is None:
            i = skip_ws(text, self.pos)
            if i == len(text):
                return None
            if text[i] != "{":
                raise _Broken
            self.start = self.sent = i
            self.span = JsonSpan(i)
        end = self.span.advance(text)
        upto = len(text) if end is None else end
        if upto > self.sent:
            events.append(Fragment(text[self.sent : upto]))
            self.sent = upto
        if end is not None:
            events.append(Closed(text[self.start : end]))
        return end


class _XmlArgs:
    """`<parameter=NAME>\\nVALUE\\n</parameter>\\n` elements, each sent as a JSON member once complete."""

    def __init__(self, pos: int, tool: str, tools: ToolSchemas):
        self.pos, self.tool, self.tools = pos, tool, tools
        self.name: str | None = None  # the parameter whose value is open
        self.vstart = self.search = 0
        self.parts: list[str] = []

    def _send(self, events: list, text: str) -> None:
        self.parts.append(text)
        events.append(Fragment(text))

    def advance(self, text: str, events: list) -> int | None:
        n = len(text)
        while True:
            if self.name is None:
                state = prefix_state(text, self.pos, PARAM)
                if state == "partial" and prefix_state(text, self.pos, "</") == "partial":
                    return None  # "<" alone: a parameter or the end
                if state == "no":  # the elements ended; the tail follows
                    self._send(events, "}" if self.parts else "{}")
                    events.append(Closed("".join(self.parts)))
                    return self.pos
                if state == "partial":
                    return None
                j = text.find(">\n", self.pos, self.pos + len(PARAM) + MAX_NAME + 2)
                if j < 0:
                    if n - self.pos > len(PARAM) + MAX_NAME + 1:
                        raise _Broken
                    return None
                self.name = text[self.pos + len(PARAM) : j]
                self.vstart = self.search = j + 2
            k = text.find(VALUE_END, self.search)
            if k < 0:
                self.search = max(self.search, n - len(VALUE_END) + 1)
                return None
            value = coerce(text[self.vstart : k], self.tools.property_schema(self.tool, self.name))
            member = json.dumps(self.name, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
            self._send(events, (", " if self.parts else "{") + member)
            self.name, self.pos = None, k + len(VALUE_END)


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _literal_value(text: str) -> Any:
    """A keyword argument's value: JSON text (what the grammar writes for strings, numbers, lists and
    dicts), else a Python literal (True, False, None, single quotes)."""
    try:
        return load_json(text)
    except ValueError:
        return json.loads(json.dumps(ast.literal_eval(text), allow_nan=False))


class _PyArgs:
    """`key=value, key=value` up to the call's closing parenthesis, each sent as a JSON member."""

    def __init__(self, pos: int):
        self.pos = pos
        self.key: str | None = None
        self.scan = self.depth = 0
        self.quote = ""
        self.parts: list[str] = []

    def _value_end(self, text: str) -> int | None:
        """Where the open value ends (a `,` or `)` outside brackets and strings), or None for now."""
        i, n = self.scan, len(text)
        while i < n:
            c = text[i]
            if self.quote:
                if c == "\\":
                    if i + 1 >= n:
                        break
                    i += 1
                elif c == self.quote:
                    self.quote = ""
            elif c in "\"'":
                self.quote = c
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    self.scan = i
                    return i
                self.depth -= 1
            elif c == "," and self.depth == 0:
                self.scan = i
                return i
            i += 1
        self.scan = i
        return None

    def advance(self, text: str, events: list) -> int | None:
        n = len(text)
        while True:
            if self.key is None:
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == ")":
                    events.append(Fragment("}" if self.parts else "{}"))
                    events.append(Closed("".join(self.parts) + ("}" if self.parts else "{}")))
                    return i
                m = _KEY.match(text, i)
                if m is None or m.end() == n:
                    if m is None:
                        raise _Broken
                    return None
                if text[m.end()] != "=":
                    raise _Broken
                self.key, self.scan, self.depth, self.quote = m.group(), m.end() + 1, 0, ""
                self.pos = m.end() + 1
            end = self._value_end(text)
            if end is None:
                return None
            try:  # a number too large for a float is not JSON either (allow_nan)
                value = json.dumps(
                    _literal_value(text[self.pos : end].strip()), ensure_ascii=False, allow_nan=False
                )
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                raise _Broken from None
            member = json.dumps(self.key, ensure_ascii=False) + ": " + value
            piece = (", " if self.parts else "{") + member
            self.parts.append(piece)
            events.append(Fragment(piece))
            self.key, self.pos = None, end + (1 if text[end] == "," else 0)


class ConstrainedScanner:
    """One section of constrained calls, from its opener (see foveal.parsing.tool_formats.base)."""

    def __init__(self, syntax: CallSyntax, names: Iterable[str], tools: ToolSchemas, olen: int):
        self.syntax, self.tools, self.olen = syntax, tools, olen
        self.heads = sorted(((syntax.head(n), n) for n in names), key=lambda h: -len(h[0]))
        self.phase, self.pos = "open", 0
        self.args: _JsonArgs | _XmlArgs | None = None
        self.emitted = self.last_end = 0

    def advance(self, text: str, final: bool) -> Step:
        events: list = []
        try:
            step = self._run(text, events)
        except _Broken:
            step = self._end(text)
        if step is None:
            step = self._end(text) if final else Step("more")
        step.calls = events
        return step

    def _end(self, text: str) -> Step:
        """Scanning stops: an open call is abandoned (all of its text is markup); else the markup ends
        after the last complete call, or is only the opener when there is none."""
        if self.args is not None:
            return Step(DONE, len(text))
        return Step(DONE, self.last_end) if self.emitted else Step(NOT_CALL, self.olen)

    def _literal(self, text: str, literal: str) -> bool | None:
        """Skip `literal` at pos: True; None while it may still come; _Broken when it does not."""
        state = prefix_state(text, self.pos, literal)
        if state == "no":
            raise _Broken
        if state == "partial":
            return None
        self.pos += len(literal)
        return True

    def _run(self, text: str, events: list) -> Step | None:
        s = self.syntax
        while True:
            if self.phase == "open":
                if self._literal(text, s.open) is None:
                    return None
                self.phase = "head"
            elif self.phase == "head":
                states = [(prefix_state(text, self.pos, h), h, name) for h, name in self.heads]
                done = next(((h, name) for st, h, name in states if st == "yes"), None)
                if done is None:
                    if any(st == "partial" for st, _, _ in states):
                        return None
                    raise _Broken
                self.pos += len(done[0])
                events.append(Opened(done[1]))
                kind = s.args_kind
                if kind == "json":
                    self.args = _JsonArgs(self.pos)
                elif kind == "xml":
                    self.args = _XmlArgs(self.pos, done[1], self.tools)
                else:
                    self.args = _PyArgs(self.pos)
                self.phase = "args"
            elif self.phase == "args":
                end = self.args.advance(text, events)
                if end is None:
                    return None
                self.args, self.pos, self.phase = None, end, "tail"
            elif self.phase == "tail":
                if self._literal(text, s.tail) is None:
                    return None
                self.emitted, self.last_end, self.phase = self.emitted + 1, self.pos, "next"
            else:  # next: the separator and another call, or the end of the section
                states = [
                    (prefix_state(text, self.pos, lit), lit) for lit in (s.sep, s.close) if lit is not None
                ]
                if s.close == "" and s.sep is None:
                    return Step(DONE, self.pos)
                hit = next((lit for st, lit in states if st == "yes" and lit), None)
                if hit is None:
                    if any(st == "partial" for st, _ in states):
                        return None
                    raise _Broken
                self.pos += len(hit)
                if hit == s.close:
                    return Step(DONE, self.pos)
                self.phase = "head"
