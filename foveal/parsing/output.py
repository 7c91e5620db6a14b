"""One chat choice's output text, split into reasoning, content and tool calls: streamed (events)
and whole (the message). The reasoning parser runs first; its content goes on to the tool-call parser
when the request offered tools (Harmony: one parser for all three).

    text deltas -> ReasoningParser -> reasoning                  -> ReasoningDelta
                                   -> content -> ToolCallStream -> ContentDelta / ToolCallDelta

Text in, protocol-neutral events out (each protocol adapter shapes them; `.to_openai()` gives OpenAI's
delta fragments): no HTTP, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from foveal.parsing.harmony import HarmonyStream
from foveal.parsing.reasoning import ReasoningFormat, ReasoningParser
from foveal.parsing.tool_formats.base import CallSyntax
from foveal.parsing.tools import ContentDelta, ReasoningDelta, ToolCall, ToolCallDelta, ToolCallStream

Event = ReasoningDelta | ContentDelta | ToolCallDelta  # one choice's output, protocol-neutral


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """How a request's choices are parsed (the same for each of its choices)."""

    reasoning: ReasoningFormat | None = None
    prompt_opened: bool = False  # the prompt opened the think block: the output starts inside it
    thinking: bool = True  # enable_thinking
    tool_format: str | None = None  # parse tool calls in this format (the request offered tools)
    tools: Sequence[Mapping[str, Any]] = ()
    tool_syntax: CallSyntax | None = None  # a tool-call grammar writes the calls: stream them as they grow
    harmony: bool = False  # gpt-oss: reasoning, content and calls from one parser (parsing/harmony.py)


@dataclass(slots=True)
class ChoiceOutput:
    """One choice's parsers. `feed` and `finish` return the choice's events, protocol-neutral
    (ReasoningDelta, ContentDelta, ToolCallDelta: each adapter shapes them, `.to_openai()` for OpenAI's
    delta fragments); `message()` is the whole message after `finish`."""

    plan: OutputPlan
    reasoning_text: list[str] = field(default_factory=list)
    content_text: list[str] = field(default_factory=list)
    _reasoner: ReasoningParser | None = None
    _tools: ToolCallStream | None = None
    _harmony: HarmonyStream | None = None

    def __post_init__(self) -> None:
        p = self.plan
        if p.harmony:
            self._harmony = HarmonyStream()
            return
        if p.reasoning is not None:
            self._reasoner = ReasoningParser(p.reasoning, thinking=p.thinking, prompt_opened=p.prompt_opened)
        if p.tool_format is not None:
            self._tools = ToolCallStream(p.tool_format, p.tools, p.tool_syntax)

    @property
    def calls(self) -> list[ToolCall]:
        if self._harmony is not None:
            return self._harmony.calls
        return self._tools.calls if self._tools is not None else []

    def feed(self, text: str) -> list[Event]:
        """The events this text completes ([] while everything is held back)."""
        if self._harmony is not None:
            return self._record(self._harmony.feed(text))
        if self._reasoner is None:
            return self._record(self._content(text, False, False))
        thought, content = self._reasoner.feed(text)
        return self._record(self._thought(thought) + self._content(content, False, False))

    def finish(self, truncated: bool = False) -> list[Event]:
        """The rest: held text, and a tool call that closed at the end. `truncated`: cut by length."""
        if self._harmony is not None:
            return self._record(self._harmony.finish(truncated))
        events: list[Event] = []
        content = ""
        if self._reasoner is not None:
            thought, content = self._reasoner.finish()
            events += self._thought(thought)
        return self._record(events + self._content(content, True, truncated))

    @staticmethod
    def _thought(text: str) -> list[Event]:
        return [ReasoningDelta(text)] if text else []

    def _content(self, text: str, final: bool, truncated: bool) -> list[Event]:
        if self._tools is None:
            return [ContentDelta(text)] if text else []
        events = self._tools.feed(text) if text else []
        if final:
            events += self._tools.finish(truncated)
        return events

    def _record(self, events) -> list[Event]:
        """Keep the texts the message is made of; drop empty text events."""
        out = []
        for e in events:
            if isinstance(e, ReasoningDelta | ContentDelta):
                if not e.text:
                    continue
                (self.reasoning_text if isinstance(e, ReasoningDelta) else self.content_text).append(e.text)
            out.append(e)
        return out

    def message(self) -> dict:
        """The whole message, after finish(): content (None when empty beside tool calls), reasoning
        (as `reasoning_content` and `reasoning`), tool_calls."""
        content = "".join(self.content_text)
        msg: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self._reasoner is not None or self._harmony is not None:
            thought = "".join(self.reasoning_text) or None
            msg["reasoning_content"] = msg["reasoning"] = thought
        if self.calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.calls
            ]
        return msg
