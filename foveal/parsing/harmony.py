"""gpt-oss's Harmony output: reasoning, content and tool calls as one sequence of messages, streamed.

    [ to=R]<|channel|>C[ to=R][ <|constrain|>T]<|message|>BODY<|end|>
    <|start|>assistant[ to=R]<|channel|>C ... <|message|>BODY<|call|>      (or <|return|>, or the end)

The prompt ends with `<|start|>assistant`, so the output begins in the first message's header. A
header ends at `<|message|>`; its channel is the word after its last `<|channel|>`, its recipient
the `to=` value (before or after the channel). Each body goes to:

    recipient functions.NAME                a call of NAME; its arguments are the body's JSON object
    another recipient (python, browser.*)   a built-in tool's call: not served here, dropped
    analysis                                reasoning
    final, commentary (a preamble)          content

A text body ends at `<|end|>`, `<|return|>` or `<|call|>`, an analysis body at `<|end|>` only (the
reasoning may quote the other markers); a call's body ends with its JSON object (markers inside its
strings are text). A header or a call that never completes (the output was cut, or is malformed) is
dropped. Text, reasoning and finished calls are emitted as they arrive; a possible start of a marker
is held back until the next text decides it, so any chunking gives the same deltas joined.
"""

from __future__ import annotations

import json
import re

from foveal.parsing.tool_formats.base import JsonSpan, skip_ws
from foveal.parsing.tools import (
    ContentDelta,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    new_call_id,
)

START, END, MESSAGE, CALL, RETURN = "<|start|>", "<|end|>", "<|message|>", "<|call|>", "<|return|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL_NAME = re.compile(r"[^\s<]*")


def detect(vocab) -> bool:
    """Whether a tokenizer (or its vocabulary) speaks Harmony: it has the message markers as tokens."""
    vocab = vocab.get_vocab() if hasattr(vocab, "get_vocab") else vocab
    return all(m in vocab for m in (START, MESSAGE, CHANNEL, END))


def _held(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops`."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


class HarmonyStream:
    """One choice's Harmony output: `feed` each text delta, then `finish` once."""

    def __init__(self):
        self.calls: list[ToolCall] = []
        self._buf = ""  # undecided text: the current header, body tail or call body
        self._mode = "header"  # header | text | call | skip
        self._kind = ""  # a text body's: "reasoning" or "content"
        self._name = ""  # a call's function name
        self._span: JsonSpan | None = None
        self._start = 0  # where the call's JSON object begins in the buffer
        self._finished = False

    def feed(self, text: str) -> list:
        if self._finished:
            raise RuntimeError("feed after finish")
        out: list = []
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self, truncated: bool = False) -> list:
        if self._finished:
            return []
        self._finished = True
        out: list = []
        self._run(out, final=True)
        if self._mode == "text" and self._buf:  # the end of the output ends the body
            self._emit(out, self._buf)
        self._buf = ""
        return out

    # -- the loop --------------------------------------------------------------------------------
    def _run(self, out: list, final: bool) -> None:
        while self._buf:
            if self._mode == "header" and not self._header():
                return
            if self._mode == "text" and not self._text(out, final):
                return
            if self._mode == "call" and not self._call(out):
                return
            if self._mode == "skip" and not self._skip():
                return

    def _header(self) -> bool:
        """A complete header switches to its body's mode; False while it is incomplete."""
        at = self._buf.find(MESSAGE)
        if at < 0:
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(MESSAGE) :]
        channel = ""
        if (c := header.rfind(CHANNEL)) >= 0:
            channel = _CHANNEL_NAME.match(header, c + len(CHANNEL)).group()
        recipients = [r for r in _RECIPIENT.findall(header) if r != "assistant"]
        recipient = recipients[-1] if recipients else None
        name = recipient.removeprefix("functions.") if recipient is not None else ""
        if recipient is not None and recipient.startswith("functions.") and name:
            self._mode, self._name, self._span = "call", name, None
        elif recipient is not None:  # a built-in tool (python, browser.*): not ours to serve
            self._mode = "skip"
        else:
            self._mode, self._kind = "text", "reasoning" if channel == "analysis" else "content"
        return True

    def _stops(self) -> tuple[str, ...]:
        return (END,) if self._kind == "reasoning" else (END, RETURN, CALL, START)

    def _text(self, out: list, final: bool) -> bool:
        stops = self._stops()
        hits = [(i, s) for s in stops if (i := self._buf.find(s)) >= 0]
        if not hits:
            keep = 0 if final else _held(self._buf, stops)
            self._emit(out, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        at, stop = min(hits)
        self._emit(out, self._buf[:at])
        self._next_message(at + (0 if stop == START else len(stop)))
        return True

    def _call(self, out: list) -> bool:
        if self._span is None:
            start = skip_ws(self._buf, 0)
            if start == len(self._buf):
                return False
            if self._buf[start] != "{":  # not a JSON object: no call
                self._mode = "skip"
                return True
            self._span, self._start = JsonSpan(start), start
        end = self._span.advance(self._buf)
        if end is None:
            return False
        body = self._buf[self._start : end]
        try:
            args = json.loads(body)
        except ValueError:
            args = None
        if isinstance(args, dict):
            call = ToolCall(new_call_id(), self._name, body)
            out.append(ToolCallDelta(len(self.calls), body, call.id, call.name))
            self.calls.append(call)
        rest = skip_ws(self._buf, end)
        for stop in (CALL, END):
            if self._buf.startswith(stop, rest):
                rest += len(stop)
                break
        self._next_message(rest)
        return True

    def _skip(self) -> bool:
        """A body no one takes: up to its end marker."""
        hits = [i + len(s) for s in (CALL, END, RETURN) if (i := self._buf.find(s)) >= 0]
        if not hits:
            return False
        self._next_message(min(hits))
        return True

    def _next_message(self, at: int) -> None:
        self._buf, self._mode, self._span = self._buf[at:], "header", None

    def _emit(self, out: list, text: str) -> None:
        if text:
            out.append(ReasoningDelta(text) if self._kind == "reasoning" else ContentDelta(text))


def parse(text: str, truncated: bool = False) -> tuple[str | None, ParsedOutput]:
    """(reasoning, content and calls) of a whole output; equal to streaming it in any chunks."""
    stream = HarmonyStream()
    deltas = stream.feed(text) + stream.finish(truncated)
    reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta)) or None
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta)) or None
    return reasoning, ParsedOutput(content, list(stream.calls))
