"""Gemma 4 tool calls: `<|tool_call>call:NAME{key:value,...}<tool_call|>`, one block per call.

The arguments are Gemma's own object syntax: unquoted keys (they may hold spaces), strings between
`<|"|>` tokens (raw: no escaping, anything but `<|"|>` inside), bare numbers / true / false / null,
nested `{...}` and `[...]`. A marker inside a string is text. Each call is sent at its closing
`<tool_call|>`; a natural stop right after the closed `{...}` closes it too.
"""

from __future__ import annotations

import re
from typing import Any

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
    load_json,
    prefix_state,
    skip_ws,
    valid_name,
)

OPEN, CLOSE, PREFIX, Q = "<|tool_call>", "<tool_call|>", "call:", '<|"|>'
_OUT = re.compile(r'[{}\[\]]|<\|"\|>')
_BARE_TOKEN = re.compile(r"[^,}\]]*")
_BARE = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class GemmaSpan:
    """Where the `{...}` opened at `start` closes: brackets outside `<|"|>` strings, incrementally."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str = start, 0, False

    def advance(self, text: str) -> int | None:
        pos, n = self.pos, len(text)
        while pos < n:
            if self.in_str:
                k = text.find(Q, pos)
                if k < 0:
                    pos = max(pos, n - len(Q) + 1)
                    break
                self.in_str, pos = False, k + len(Q)
                continue
            m = _OUT.search(text, pos)
            if m is None:
                pos = max(pos, n - len(Q) + 1)  # `<|"` may be the start of a string token
                break
            c, pos = m.group(), m.end()
            if c == Q:
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return None


def parse_gemma_object(s: str) -> dict | None:
    """The `{...}` text as a dict, or None if it is not Gemma's object syntax."""
    try:
        value, i = _value(s, 0)
    except (ValueError, IndexError, RecursionError):
        return None
    return value if isinstance(value, dict) and skip_ws(s, i) == len(s) else None


def _value(s: str, i: int) -> tuple[Any, int]:
    i = skip_ws(s, i)
    if s.startswith(Q, i):
        k = s.index(Q, i + len(Q))
        return s[i + len(Q) : k], k + len(Q)
    if s[i] == "{":
        out: dict = {}
        i = skip_ws(s, i + 1)
        if s[i] == "}":
            return out, i + 1
        while True:
            i = skip_ws(s, i)
            if s.startswith(Q, i):  # a quoted key
                k = s.index(Q, i + len(Q))
                key, i = s[i + len(Q) : k], skip_ws(s, k + len(Q))
            else:
                k = s.index(":", i)
                key, i = s[i:k].strip(), k
            if not key or s[i] != ":":
                raise ValueError("bad key")
            out[key], i = _value(s, i + 1)
            i = skip_ws(s, i)
            if s[i] == "}":
                return out, i + 1
            if s[i] != ",":
                raise ValueError("expected , or }")
            i += 1
    if s[i] == "[":
        items: list = []
        i = skip_ws(s, i + 1)
        if s[i] == "]":
            return items, i + 1
        while True:
            item, i = _value(s, i)
            items.append(item)
            i = skip_ws(s, i)
            if s[i] == "]":
                return items, i + 1
            if s[i] != ",":
                raise ValueError("expected , or ]")
            i += 1
    m = _BARE_TOKEN.match(s, i)
    token = m.group().strip()
    if token in _BARE:
        return _BARE[token], m.end()
    number = load_json(token)  # ValueError if it is not a number
    if isinstance(number, bool) or not isinstance(number, int | float):
        raise ValueError("not a bare value")
    return number, m.end()


class Gemma4Scanner:
    def __init__(self, opener: str):
        self.olen = len(opener)
        self.phase, self.pos = "prefix", self.olen
        self.name = ""
        self.span: GemmaSpan | None = None
        self.start = 0
        self.args: dict | None = None

    def advance(self, text: str, final: bool) -> Step:
        step = self._run(text)
        if step is not None:
            return step
        if not final:
            return Step(MORE)
        if self.args is not None:  # stopped right after the arguments: the stop closes the call
            return Step(DONE, len(text), [(self.name, dump_arguments(self.args))])
        return Step(NOT_CALL, self.olen)

    def _run(self, text: str) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "prefix":
                i = skip_ws(text, self.pos)
                state = prefix_state(text, i, PREFIX)
                if state != "yes":
                    return None if state == "partial" else Step(NOT_CALL, self.olen)
                self.phase, self.pos = "name", i + len(PREFIX)
            elif self.phase == "name":
                k = text.find("{", self.pos, self.pos + MAX_NAME + 1)
                if k < 0:
                    partial = text[self.pos :].strip()  # decided as the whole name would be
                    stuck = n - self.pos > MAX_NAME or (partial and not valid_name(partial))
                    return Step(NOT_CALL, self.olen) if stuck else None
                self.name = text[self.pos : k].strip()
                if not valid_name(self.name):
                    return Step(NOT_CALL, self.olen)
                self.phase, self.span = "args", GemmaSpan(k)
                self.start = k
            elif self.phase == "args":
                end = self.span.advance(text)
                if end is None:
                    return None
                self.args = parse_gemma_object(text[self.start : end])
                if self.args is None:
                    return Step(NOT_CALL, self.olen)
                self.phase, self.pos = "close", end
            else:
                i = skip_ws(text, self.pos)
                state = prefix_state(text, i, CLOSE)
                if state != "yes":
                    return None if state == "partial" else Step(NOT_CALL, self.olen)
                return Step(DONE, i + len(CLOSE), [(self.name, dump_arguments(self.args))])


class Gemma4(ToolFormat):
    name = "gemma4"
    aliases = ("gemma", "gemma_4")
    markers = ToolMarkers(
        triggers=(OPEN,),
        start_triggers=(),
        call_close=CLOSE,
        args_open="{",
        body="gemma4_object",
        markup=(OPEN, CLOSE, Q),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> Gemma4Scanner:
        return Gemma4Scanner(opener)
