"""Pythonic tool calls (Llama 4, Llama 3.2 with the pythonic template, and others):
`[get_weather(city="Paris"), get_time()]`, optionally wrapped in `<|python_start|>...<|python_end|>`.

The list counts at the start of the output (or right after a call), or after `<|python_start|>`,
and only if it begins like a call (`[name(`); `[1]` or `[link](url)` are content at once. Each
element is parsed with Python's `ast` and its keyword values with `ast.literal_eval`: literals only
(strings, numbers, True/False/None, lists, dicts, tuples), never evaluated code. A call with
positional arguments, `**kwargs` or a non-literal value is not a call. Each element is sent as soon
as its closing parenthesis arrives, so a list cut short keeps its complete calls.
"""

from __future__ import annotations

import ast
import re

from foveal.parsing.tool_formats.base import (
    DONE,
    MAX_NAME,
    CallSyntax,
    PySpan,
    RunScanner,
    Step,
    ToolFormat,
    ToolMarkers,
    ToolSchemas,
    dump_arguments,
    skip_ws,
    valid_name,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")


def parse_python_call(src: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one `name(k=literal, ...)` expression, or None."""
    try:
        node = ast.parse(src, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    parts = []
    func = node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return None
    name = ".".join([func.id, *reversed(parts)])
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:  # tuples become lists; sets, bytes, complex numbers and NaN are refused
        return (name, dump_arguments(args)) if valid_name(name) else None
    except (TypeError, ValueError):
        return None


class PythonicScanner(RunScanner):
    def __init__(self, opener: str):
        self.wrapped = opener == PYTHON_START
        self.olen = len(opener)
        self.phase = "open" if self.wrapped else "element"
        self.pos = self.olen
        self.span: PySpan | None = None
        self.start = 0
        self.emitted, self.last_end = 0, 0

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        n = len(text)
        while True:
            if self.phase == "open":  # after <|python_start|>: the list
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] != "[":
                    return self._give_up()
                self.phase, self.pos = "element", i + 1
            elif self.phase == "element":  # a dotted name, then `(`
                if self.span is None:
                    i = skip_ws(text, self.pos)
                    end = _DOTTED.match(text, i)
                    end = end.end() if end else i
                    if end - i > MAX_NAME or (end == i and i < n):
                        return self._give_up()
                    if end == n:
                        return None
                    if text[end] != "(":
                        return self._give_up()
                    self.start, self.span = i, PySpan(end)
                close = self.span.advance(text)
                if close is None:
                    return None
                self.span = None
                call = parse_python_call(text[self.start : close])
                if call is None:
                    return self._give_up()
                calls.append(call)
                self.emitted, self.last_end, self.pos = self.emitted + 1, close, close
                self.phase = "sep"
            else:  # sep: `,` and the next element, or `]`
                i = skip_ws(text, self.pos)
                if i == n:
                    return None
                if text[i] == "]":
                    return Step(DONE, i + 1, closer=PYTHON_END if self.wrapped else None)
                if text[i] != ",":
                    return self._give_up()
                self.phase, self.pos = "element", i + 1


class Pythonic(ToolFormat):
    name = "pythonic"
    aliases = ("llama4_pythonic", "llama4", "llama3_pythonic", "llama32_pythonic")
    markers = ToolMarkers(
        triggers=(PYTHON_START,),
        start_triggers=("[",),
        call_close=None,
        args_open=None,
        body="python_calls",
        markup=(PYTHON_START, PYTHON_END, "<|eom|>", "<|eot|>"),
    )

    def scanner(self, opener: str, tools: ToolSchemas) -> PythonicScanner:
        return PythonicScanner(opener)

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax:
        # a list of calls; wrapped in <|python_start|> ... <|python_end|> where those are special tokens
        # (Llama 4), which also makes the wrapper a trigger in free text
        wrap = PYTHON_START in special and PYTHON_END in special
        return CallSyntax(
            head=lambda name: name + "(",
            tail=")",
            args_kind="python",
            open=(PYTHON_START if wrap else "") + "[",
            sep=", ",
            close="]" + (PYTHON_END if wrap else ""),
            trigger=PYTHON_START if wrap else None,
            start=None if wrap else r"\s*\[\s*[A-Za-z_][A-Za-z0-9_.]*\(",
        )
