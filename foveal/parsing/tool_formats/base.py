"""What every tool-call format shares: the scan protocol between the stream engine and a format, the
markers a format publishes, and the scanning helpers (JSON and Python bracket spans, call objects).

A format does not stream and does not decide policy. The engine (`foveal.parsing.tools`) finds an
opener in the text, then hands the text from that opener to the format's `Scanner`, again each time
more text arrives (the text only grows). The scanner answers with a `Step`:

    calls      calls that became complete in this advance (name, arguments JSON text), in order
    status     MORE      the call (or the list of calls) is still open: hold the text
               DONE      the markup ends at `end`; the text after it is content again
               NOT_CALL  this is not a call: text[:end] (the opener) goes back to content

With `final=True` (the model stopped on its own) a scanner must not answer MORE: an open call is
either complete enough (DONE) or not a call. Scanners keep their own offsets, so each character is
looked at a bounded number of times however the text is chunked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

MORE, DONE, NOT_CALL = "more", "done", "not_call"


@dataclass(frozen=True, slots=True)
class Opened:
    """A call's name is known and its arguments have begun (constrained output only: streamed early)."""

    name: str


@dataclass(frozen=True, slots=True)
class Fragment:
    """More of the open call's arguments text (after `Opened`)."""

    text: str


@dataclass(frozen=True, slots=True)
class Closed:
    """The open call is complete; `arguments` is the whole text its fragments joined to."""

    arguments: str


@dataclass(slots=True)
class Step:
    status: str
    end: int = 0
    # complete calls as (name, arguments JSON text); a constrained scanner reports Opened, Fragment and
    # Closed instead, as the call grows
    calls: list[tuple[str, str] | Opened | Fragment | Closed] = field(default_factory=list)
    closer: str | None = None  # DONE: an optional closing marker the engine skips if it comes next


class Scanner(Protocol):
    def advance(self, text: str, final: bool) -> Step: ...


class RunScanner:
    """A scanner of calls written one after another (a list, a section): `_run` goes on over the text,
    appending calls as they complete, and returns a Step once the markup ends, or None while more may
    come. At a broken call, or the end of the output inside the markup, calls already sent make the
    markup end where the last one did; without any, the opener is plain text."""

    olen: int  # the opener's length
    emitted: int  # calls sent
    last_end: int  # where the last sent call's markup ended

    def _run(self, text: str, calls: list[tuple[str, str]]) -> Step | None:
        raise NotImplementedError

    def _give_up(self) -> Step:
        return Step(DONE, self.last_end) if self.emitted else Step(NOT_CALL, self.olen)

    def advance(self, text: str, final: bool) -> Step:
        calls: list[tuple[str, str]] = []
        step = self._run(text, calls)
        if step is None:
            step = self._give_up() if final else Step(MORE)
        step.calls = calls
        return step


@dataclass(frozen=True, slots=True)
class ToolMarkers:
    """The strings that delimit calls, as data (for a grammar trigger and for leak checks).

    triggers        strings that open a call anywhere in the output (`triggers[0]` is the main one)
    start_triggers  characters that open a call only at the start of the output or right after a
                    call (bare JSON / Python lists: `{`, `[`), whitespace before them allowed
    call_close      what closes one call, or None where the end of the JSON closes it
    args_open       what separates a name from its arguments (Mistral v11+: `[ARGS]`), else None
    body            the syntax between open and close, for a grammar builder: "json_name_arguments"
                    (hermes), "xml_function" (qwen3_xml), "json_name_parameters" (llama3_json),
                    "mistral", "python_calls" (pythonic), "glm_arg_pairs", "deepseek_v3", "dsml",
                    "kimi_k2", "gemma4_object"
    markup          every marker string of the format (never content, never in names)
    """

    triggers: tuple[str, ...]
    start_triggers: tuple[str, ...]
    call_close: str | None
    args_open: str | None
    body: str
    markup: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """The exact text a format's calls take when the output is constrained (by a tool-call grammar):
    what `foveal.structured.tool_grammar` builds the grammar from, and what the constrained scanner
    streams from. A section is `open call (sep call)* close`; sections follow each other, `between`
    apart (None: one section per output); a call is `head(name) arguments tail`, its arguments
    `args_kind` ("json": a JSON object; "xml": `<parameter=...>` elements). In free text (tool_choice
    auto) a section starts at `trigger`, a prefix of `open + head(name)` (None: auto is not
    constrained), or where `start` is set, a section that opens the output (a bare JSON object or
    Python list): `start` is the regex of the output's beginning that makes it a call, and under auto
    free text may not begin that way."""

    head: Callable[[str], str]
    tail: str
    args_kind: str = "json"
    open: str = ""
    sep: str | None = None
    close: str = ""
    between: str | None = None
    trigger: str | None = None
    start: str | None = None


class ToolFormat:
    """One tool-call syntax. Subclasses set the class attributes and implement `scanner`, and
    `call_syntax` where calls can be constrained."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    markers: ToolMarkers
    # True where the chat template writes newlines around calls: whitespace that separates content
    # from a call is then markup (see the policy in foveal.parsing.tools)
    trim_separators: bool = False

    def scanner(self, opener: str, tools: ToolSchemas) -> Scanner:
        raise NotImplementedError

    def call_syntax(self, special: frozenset[str] = frozenset()) -> CallSyntax | None:
        """The syntax a tool-call grammar writes, or None where this format has no builder. `special`:
        the format's markers that are special tokens of the tokenizer (some shapes depend on them)."""
        return None

    def __repr__(self) -> str:
        return f"<tool format {self.name}>"


class ToolSchemas:
    """The offered tools by name: parameter schemas for typing values (Qwen XML)."""

    def __init__(self, tools: Iterable[Mapping[str, Any]] | None):
        self.params: dict[str, dict] = {}
        for tool in tools or ():
            fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self.params[fn["name"]] = params if isinstance(params, dict) else {}

    def property_schema(self, tool: str, param: str) -> dict | None:
        """The JSON schema of one parameter, or None when the tool or the parameter is unknown."""
        props = self.params.get(tool, {}).get("properties")
        if isinstance(props, dict) and isinstance(props.get(param), dict):
            return props[param]
        return None


# ---- text helpers ----------------------------------------------------------------------------


def prefix_state(text: str, pos: int, literal: str) -> str:
    """Whether text[pos:] starts with `literal` ("yes"), is a proper prefix of it ("partial"), or
    neither ("no")."""
    rest = text[pos : pos + len(literal)]
    if rest == literal:
        return "yes"
    return "partial" if literal.startswith(rest) else "no"


def skip_ws(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


_OUT_JSON = re.compile(r'[\[\]{}"]')
_IN_JSON = re.compile(r'[\\"]')


class JsonSpan:
    """Finds where the JSON value opened by the bracket at `start` closes, incrementally.

    It only matches brackets outside strings; validity is checked once the span is closed (json).
    """

    __slots__ = ("pos", "depth", "in_str")

    def __init__(self, start: int):
        self.pos, self.depth, self.in_str = start, 0, False

    def advance(self, text: str) -> int | None:
        """The index just past the closing bracket, or None while the value is still open."""
        pos, n = self.pos, len(text)
        while pos < n:
            if self.in_str:
                m = _IN_JSON.search(text, pos)
                if m is None:
                    pos = n
                    break
                j = m.start()
                if m.group() == "\\":
                    if j + 1 >= n:  # the escaped character has not arrived yet
                        pos = j
                        break
                    pos = j + 2
                    continue
                self.in_str, pos = False, j + 1
                continue
            m = _OUT_JSON.search(text, pos)
            if m is None:
                pos = n
                break
            c, pos = m.group(), m.end()
            if c == '"':
                self.in_str = True
            elif c in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return None


_OUT_PY = re.compile(r"[\[\](){}'\"]")
_IN_PY = {q: re.compile(r"\\|" + re.escape(q)) for q in ("'", '"', "'''", '"""')}


class PySpan:
    """Like JsonSpan for a Python expression: (), [], {} outside '...', "...", and triple quotes."""

    __slots__ = ("pos", "depth", "quote")

    def __init__(self, start: int):
        self.pos, self.depth, self.quote = start, 0, ""

    def advance(self, text: str) -> int | None:
        pos, n = self.pos, len(text)
        while pos < n:
            if self.quote:
                m = _IN_PY[self.quote].search(text, pos)
                if m is None:  # keep what could be the start of a closing triple quote
                    pos = max(pos, n - len(self.quote) + 1)
                    break
                if m.group() == "\\":
                    if m.end() >= n:
                        pos = m.start()
                        break
                    pos = m.end() + 1
                    continue
                self.quote, pos = "", m.end()
                continue
            m = _OUT_PY.search(text, pos)
            if m is None:
                pos = n
                break
            c, j = m.group(), m.start()
            if c in "'\"":
                if text[j : j + 3] == c * 3:
                    self.quote = c * 3
                elif j + 3 > n and text[j:] == c * (n - j):  # may still become a triple quote
                    pos = j
                    break
                else:
                    self.quote = c
                pos = j + len(self.quote)
            elif c in "([{":
                self.depth, pos = self.depth + 1, j + 1
            else:
                self.depth, pos = self.depth - 1, j + 1
                if self.depth == 0:
                    self.pos = pos
                    return pos
        self.pos = pos
        return None


# ---- call objects ----------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def load_json(text: str) -> Any:
    """Strict JSON: NaN and Infinity are refused (they are not JSON; clients would choke)."""
    return json.loads(text, parse_constant=_no_constants)


def dump_arguments(args: Mapping[str, Any]) -> str:
    """Arguments as JSON text (TypeError / ValueError for what JSON cannot hold, NaN included)."""
    text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\\ud83c" in the model's JSON): keep it escaped
        return json.dumps(args, allow_nan=False)
    return text


NOT_ARGS = object()  # read_json_args: what is there is no JSON object of arguments


def read_json_args(scan: Any, text: str) -> dict | None | object:
    """A call's JSON object of arguments from `scan.pos` on (whitespace first), across advances: the
    dict once it closed (`scan.pos` then past it), None while it may still be open, NOT_ARGS where it is
    not an object. Keeps its progress in `scan.span` / `scan.start`."""
    if scan.span is None:
        i = skip_ws(text, scan.pos)
        if i == len(text):
            return None
        if text[i] != "{":
            return NOT_ARGS
        scan.start, scan.span = i, JsonSpan(i)
    end = scan.span.advance(text)
    if end is None:
        return None
    try:
        args = arguments_object(load_json(text[scan.start : end]))
    except ValueError:
        args = None
    scan.span = None
    if args is None:
        return NOT_ARGS
    scan.pos = end
    return args


def arguments_object(value: Any) -> dict | None:
    """A call's arguments as a dict: an object, or a string holding a JSON object (some models
    double-encode); anything else is not a call."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            inner = load_json(value)
        except ValueError:
            return None
        return inner if isinstance(inner, dict) else None
    return None


def call_from_object(
    obj: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters"), require_args: bool = False
) -> tuple[str, str] | None:
    """(name, arguments JSON text) from a `{"name": ..., "arguments": {...}}` object, or None."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not valid_name(name):
        return None
    present = [k for k in arg_keys if k in obj]
    if not present:
        return None if require_args else (name, "{}")
    args = arguments_object(obj[present[0]])
    return None if args is None else (name, dump_arguments(args))


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]*")
MAX_NAME = 256  # longer "names" are text, not a call (bounds how long content can be held back)


def valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME and _NAME.fullmatch(name) is not None
