"""Tool calls out of raw model text: one-shot (`parse`) and streaming (`ToolCallStream`), for the
formats in `foveal.parsing.tool_formats` (hermes, qwen3_xml, llama3_json, mistral, pythonic, glm,
deepseek_v3, deepseek_dsml, kimi_k2, gemma4), chosen by name (`get_format`, for
`--tool-call-parser`) or from the chat template and vocabulary (`detect`).

This module owns the policy and the streaming; each format only scans its own syntax. It does not
know about requests, tokens or HTTP; reasoning (`<think>`) is split off before text reaches it.

Policy
------
- Content around calls is ordinary content, concatenated verbatim in order. Whitespace that only
  separates calls (from each other, from the start or the end of the output) is markup. Where the
  chat template writes a newline before each call (hermes, qwen3_xml, glm, deepseek_dsml) the
  whitespace between text and the call after it is markup too: `"Let me check.\\n<tool_call>..."`
  gives `"Let me check."`; text after a call keeps its leading whitespace (`"A\\n<call>\\nB"` gives
  `"A\\nB"`).
- Malformed markup is content: a marker followed by something that is not a call (bad JSON, a
  truncated XML tag at a natural stop, a non-literal Python argument) gives its text back verbatim,
  marker included, and scanning goes on after the marker. No call is ever half-parsed or repaired.
- Truncated output (`finish(truncated=True)`, i.e. `finish_reason: "length"`): a call still open at
  the cut is dropped, its text is neither a call nor content; complete calls before it are kept. At
  a natural stop (`truncated=False`) the end of the output may close a call whose body is complete
  (hermes without `</tool_call>`); anything less is content.
- Unknown tool names (not among the offered tools) are returned as calls, unchanged: the client can
  answer with a tool error and the model can recover, whereas turning the call into content would
  leak markup and hide what the model asked for. Qwen XML values of an unknown tool are untyped
  (JSON objects/arrays decoded, the rest strings).
- Ids are `call_` + 24 random hex digits, unique within a stream.

Streaming: a partial call is sent only where a grammar wrote it
--------------------------------------------------------------
Output can be cut by max_tokens at any token, and free text can turn out not to be a call, so a call
parsed from free text is held until it is complete (closer seen, or its JSON / Python closed), then
sent as two deltas: `{index, id, type: "function", function: {name, arguments: ""}}` and
`{index, function: {arguments: <the whole JSON object text>}}`. Cost: the first byte of such a call
comes when its last token has been generated; content is not delayed, except text that could be the
start of a marker (fewer characters than the marker) and trailing whitespace (held until the next
character decides whether it is a separator). Outputs that start with a bare `{"name"` (llama3_json)
or `[f(` (pythonic) are held until they close.

Where a tool-call grammar constrains the calls (`syntax`: tool_choice required or named, and auto
for every format with a call syntax), the text is a call by construction: the id and name go out as
soon as the call's head is complete and the arguments follow in fragments as the model writes them
(`tool_formats.constrained`); `arguments` is then the model's own JSON text (XML and Python arguments
are sent as JSON, a parameter at a time). A call cut short by max_tokens after it opened has had its
beginning streamed (the finish_reason "length" says it is cut) and is not among the complete `calls`
(a non-streamed response does not show it).

Decisions depend only on the text, never on how it was chunked, so every chunking gives the same
result as `parse`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from foveal.parsing.tool_formats import FORMATS, ToolFormat, ToolMarkers
from foveal.parsing.tool_formats.base import (
    DONE,
    MORE,
    CallSyntax,
    Closed,
    Fragment,
    Opened,
    Scanner,
    ToolSchemas,
    prefix_state,
    skip_ws,
)
from foveal.parsing.tool_formats.constrained import ConstrainedScanner

__all__ = [
    "FORMATS",
    "ContentDelta",
    "ParsedOutput",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolFormat",
    "ToolMarkers",
    "collect",
    "detect",
    "get_format",
    "new_call_id",
    "parse",
]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"content": self.text}


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """Reasoning text (a think block, Harmony's analysis channel)."""

    text: str

    def to_openai(self) -> dict[str, Any]:
        return {"reasoning_content": self.text, "reasoning": self.text}


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The first delta of a call has `id` and `name` (and arguments ""); later ones only arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        call: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            call["id"], call["type"] = self.id, "function"
            call["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            call["function"] = {"arguments": self.arguments}
        return {"tool_calls": [call]}


Delta = ContentDelta | ToolCallDelta


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def get_format(name: str) -> ToolFormat:
    """A format by name or alias (`--tool-call-parser`)."""
    key = name.strip().lower().replace("-", "_")
    for fmt in FORMATS.values():
        if key == fmt.name or key in fmt.aliases:
            return fmt
    raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(FORMATS)}")


def detect(chat_template: str | None, vocab: Any = None) -> ToolFormat | None:
    """The format whose markers the chat template (or, failing that, the vocabulary) uses; None when
    nothing points to a known format (then tool calls are not parsed). `vocab`: a tokenizer (with
    `get_vocab()`), a token -> id mapping, or token strings."""
    t = chat_template or ""
    get_vocab = getattr(vocab, "get_vocab", None)  # a tokenizer
    v = get_vocab() if callable(get_vocab) else vocab if isinstance(vocab, Mapping) else set(vocab or ())

    def has(marker: str) -> bool:
        return marker in t or marker in v

    if has("[TOOL_CALLS]"):
        return FORMATS["mistral"]
    if has("｜DSML｜"):  # DeepSeek V3.2+ (no Jinja template: the vocabulary tells)
        return FORMATS["deepseek_dsml"]
    if has("<｜tool▁calls▁begin｜>"):
        return FORMATS["deepseek_v3"]
    if has("<|tool_calls_section_begin|>"):
        return FORMATS["kimi_k2"]
    if has("<|tool_call>"):
        return FORMATS["gemma4"]
    if "<arg_key>" in t:
        return FORMATS["glm"]
    if "<function=" in t and "<parameter=" in t:
        return FORMATS["qwen3_xml"]
    if "<tool_call>" in t:
        return FORMATS["hermes"]
    if "func_name1(" in t or "[func_name" in t or has("<|python_start|>"):
        return FORMATS["pythonic"]  # Llama 4 (and Llama 3.2's pythonic template)
    if has("<|python_tag|>") or '"parameters": dictionary of argument name' in t:
        return FORMATS["llama3_json"]
    if "<arg_key>" in v:
        return FORMATS["glm"]
    if "<tool_call>" in v:  # a Qwen/Hermes vocabulary whose template says nothing more
        return FORMATS["hermes"]
    return None


class ToolCallStream:
    """One request's tool-call parser: `feed` each text delta, then `finish` once. `syntax`: the
    layout a tool-call grammar gives the calls (streamed as they grow), or None for free text."""

    def __init__(
        self,
        format: ToolFormat | str,
        tools: Iterable[Mapping[str, Any]] | None = None,
        syntax: CallSyntax | None = None,
    ):
        self.format = get_format(format) if isinstance(format, str) else format
        self.calls: list[ToolCall] = []
        self._schemas = ToolSchemas(tools)
        self._syntax = syntax
        self._open: tuple[str, str, int] | None = None  # a streamed call not closed yet: id, name, index
        self._triggers = self.format.markers.triggers
        self._start_triggers = "".join(self.format.markers.start_triggers)
        self._buf = ""  # text not decided yet: a possible marker start, or an open call
        self._scanner: Scanner | None = None
        self._closer: str | None = None  # an optional closing marker to skip after a call
        self._ws = ""  # trailing whitespace of the content, held until we know what it separates
        self._seg_text = False  # the content since the start / the last call has non-whitespace
        self._after_call = False
        self._ids: set[str] = set()
        self._finished = False
        self.dropped = False  # finish(truncated=True) dropped a call that never closed (for logs)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed after finish")
        out: list[Delta] = []
        if text:
            buf, self._buf = self._buf, ""
            buf += text  # the only reference: CPython appends in place (a long call stays linear)
            self._buf = buf
            self._run(out, final=False, truncated=False)
        return _merge(out)

    def finish(self, truncated: bool = False) -> list[Delta]:
        """The rest of the output. `truncated`: the model was cut (max_tokens), not stopped."""
        if self._finished:
            return []
        self._finished = True
        out: list[Delta] = []
        self._run(out, final=True, truncated=truncated)
        if self._ws and (self._seg_text or not self._after_call):
            out.append(ContentDelta(self._ws))  # whitespace at the end, after text: verbatim
        self._ws = ""
        return _merge(out)

    # ---- the loop -----------------------------------------------------------------------------

    def _run(self, out: list[Delta], final: bool, truncated: bool) -> None:
        while True:
            if self._scanner is not None:
                if final and truncated:  # the call never closed: drop it (a streamed one was cut short)
                    self._close_segment(out)
                    self._scanner, self._buf, self._open, self.dropped = None, "", None, True
                    return
                step = self._scanner.advance(self._buf, final)
                for event in step.calls:
                    self._event(out, event)
                if step.status == MORE:
                    return
                if self._open is not None:  # the scan ended inside a call: abandoned
                    self._open, self.dropped = None, True
                if step.status == DONE:
                    self._closer = step.closer
                else:  # not a call: the opener is content, and scanning resumes after it
                    self._content(out, self._buf[: step.end])
                self._buf = self._buf[step.end :]
                self._scanner = None
                continue
            if self._closer is not None and not self._skip_closer(final):
                return
            at, opener = self._find_opener()
            if opener is not None:
                self._content(out, self._buf[:at])
                self._buf = self._buf[at:]
                self._scanner = self._new_scanner(opener)
                continue
            keep = 0 if final else self._partial_marker_len()
            if final and truncated and self._syntax is not None:  # under a tool grammar a marker cut
                self._buf = self._buf[: len(self._buf) - self._partial_marker_len()]  # short is markup
            self._content(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return

    def _new_scanner(self, opener: str) -> Scanner:
        if self._syntax is None:
            return self.format.scanner(opener, self._schemas)
        return ConstrainedScanner(self._syntax, self._schemas.params, self._schemas, len(opener))

    def _find_opener(self) -> tuple[int, str | None]:
        best, opener = len(self._buf), None
        for t in self._triggers:
            i = self._buf.find(t)
            if 0 <= i < best:
                best, opener = i, t
        if self._start_triggers and not self._seg_text:
            i = skip_ws(self._buf, 0)
            if i < best and self._buf[i] in self._start_triggers:
                best, opener = i, self._buf[i]
        return best, opener

    def _partial_marker_len(self) -> int:
        """How many trailing characters could be the start of a marker."""
        buf, keep = self._buf, 0
        for t in self._triggers:
            for k in range(min(len(t) - 1, len(buf)), keep, -1):
                if buf.endswith(t[:k]):
                    keep = k
                    break
        return keep

    def _skip_closer(self, final: bool) -> bool:
        """Skip whitespace + the closing marker after a call if it comes; False: wait for more."""
        i = skip_ws(self._buf, 0)
        state = prefix_state(self._buf, i, self._closer)
        if state == "yes":
            self._buf = self._buf[i + len(self._closer) :]
        elif state == "partial":
            if not final:
                return False
            self._buf = ""  # a closer cut short is still markup
        self._closer = None
        return True

    # ---- emitting ----------------------------------------------------------------------------

    def _content(self, out: list[Delta], text: str) -> None:
        if not text:
            return
        if not self._seg_text:
            body = text.lstrip()
            if not body:
                self._ws += text
                return
            self._ws += text[: len(text) - len(body)]
            self._seg_text, text = True, body
        body = text.rstrip()
        if body:
            out.append(ContentDelta(self._ws + body))
            self._ws = ""
        self._ws += text[len(body) :]

    def _close_segment(self, out: list[Delta]) -> None:
        """A call (or a dropped one) ends the content segment: settle its trailing whitespace."""
        if self._ws and self._seg_text and not self.format.trim_separators:
            out.append(ContentDelta(self._ws))  # "text <call>": the space belongs to the text
        self._ws, self._seg_text, self._after_call = "", False, True

    def _event(self, out: list[Delta], event: Any) -> None:
        if isinstance(event, tuple):  # a whole call
            self._event(out, Opened(event[0]))
            self._event(out, Fragment(event[1]))
            self._event(out, Closed(event[1]))
        elif isinstance(event, Opened):
            self._close_segment(out)
            call_id = new_call_id()
            while call_id in self._ids:
                call_id = new_call_id()
            self._ids.add(call_id)
            self._open = (call_id, event.name, len(self.calls))
            out.append(ToolCallDelta(len(self.calls), "", id=call_id, name=event.name))
        elif isinstance(event, Fragment):
            out.append(ToolCallDelta(self._open[2], event.text))
        else:
            call_id, name, _ = self._open
            self.calls.append(ToolCall(call_id, name, event.arguments))
            self._open = None


def _merge(deltas: list[Delta]) -> list[Delta]:
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + d.text)
        elif (
            isinstance(d, ToolCallDelta)
            and d.id is None
            and isinstance(last, ToolCallDelta)
            and last.id is None
            and last.index == d.index
        ):
            out[-1] = ToolCallDelta(d.index, last.arguments + d.arguments)  # argument fragments: one delta
        else:
            out.append(d)
    return out


def collect(deltas: Iterable[Delta]) -> ParsedOutput:
    """Join deltas into the message they describe (what a client accumulating the stream has)."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for d in deltas:
        if isinstance(d, ContentDelta):
            content.append(d.text)
        elif d.id is not None:
            calls[d.index] = [d.id, d.name or "", d.arguments]
        else:
            calls[d.index][2] += d.arguments
    return ParsedOutput("".join(content) or None, [ToolCall(*calls[i]) for i in sorted(calls)])


def parse(
    text: str,
    tools: Iterable[Mapping[str, Any]] | None = None,
    *,
    format: ToolFormat | str,
    truncated: bool = False,
    syntax: CallSyntax | None = None,
) -> ParsedOutput:
    """The whole output at once; equal to streaming it in any chunks."""
    stream = ToolCallStream(format, tools, syntax)
    content = collect(stream.feed(text) + stream.finish(truncated)).content
    return ParsedOutput(content, list(stream.calls))  # without a streamed call that was cut short
