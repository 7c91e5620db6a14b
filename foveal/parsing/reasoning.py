"""Reasoning ("thinking") parsers: split a model's output text into reasoning and content.

Owns the registry of think-marker formats (`FORMATS`), picking one from a tokenizer's vocabulary
(`detect`), telling whether a rendered prompt already opened the think block
(`prompt_opens_thinking`), and the per-request incremental splitter (`ReasoningParser`) with its
one-shot form (`parse`). Text in, text out: no token ids in the parser, no engine or server
imports. It does not force the end marker for a thinking budget (the engine does, reading
`ReasoningParser.in_reasoning`) and does not parse tool calls: tool-call markup stays in the
content part, for the tool parser.

Policy (vLLM's reasoning-parser tests record vLLM's; our deliberate differences are listed below):

1. Where the output starts. Inside the reasoning block when the prompt opened it
   (`prompt_opened=True`: the generation prompt ends with "<think>\\n", as Qwen3-Thinking-2507,
   Qwen3.5+, DeepSeek V3.1+ in thinking mode, GLM-4.7 and Kimi K2.6 render it). In content,
   waiting for a start marker, when it did not (`prompt_opened=False`). When the prompt is
   unknown (None), the format's `bare` policy decides what output without markers is:
   "reasoning" for deepseek_r1, qwen3, kimi_k2 and seed_oss (as vLLM: a model of theirs that emits
   no marker is inside a block the template opened), "content" for the rest.
2. `thinking=False` (the request's enable_thinking=False) with a prompt that did not open a block:
   the output is content, passed through untouched, and reasoning is None. A prompt that did open
   a block wins over the flag: the model is inside it whatever the request said.
3. Text before the start marker, when the output starts in content, is content, except
   whitespace-only text, which is dropped (GLM-4.5 writes "\\n<think>"). Only the first start
   marker opens a block; once the block has ended, markers are plain content text. When the output
   starts inside a block, a start marker is dropped wherever it appears in the block (the model
   re-opened the block the template opened); text before it stays reasoning.
4. Separator newlines are not text: newlines at the start of the block (after the start marker,
   or at the start of a prompt-opened block), right before the end of the block, and right after
   the end marker are dropped. Qwen3 writes "<think>\\nR\\n</think>\\n\\nC" and its template stores
   R and C without them; so do the canitoolcall fixtures. Other whitespace, and newlines anywhere
   else, are kept.
5. No end marker: everything after the opening is reasoning (the output was cut inside the block)
   and content is None, as in vLLM. A format may name implicit ends: qwen3 ends reasoning at
   "<tool_call>" followed, after whitespace, by "<function" (Qwen3.5 calls tools from inside an
   unclosed block; a bare mention of "<tool_call>" does not end it), kimi_k2 at
   "<|tool_calls_section_begin|>". The opener and what follows are content, for the tool parser.
6. Empty parts are None in `parse()`; stream deltas are "" when there is nothing to send. One
   rule for streamed and non-streamed output.
7. Split invariance: any chunking of one output gives the same concatenated reasoning and content
   as `parse()`. A possible partial marker, the trailing newlines of reasoning (rule 4) and
   whitespace that may precede a start marker (rule 3) are held back until the next chunk or
   `finish()`; a marker is never emitted in part. At `finish()` held text is text.

Deliberate differences from vLLM's recorded vectors (tests/test_reasoning_parser.py lists the ids):
- "" vs None (rule 6): vLLM's non-streamed deepseek_r1 path returns reasoning "" for
  "</think>x" and for empty output, where its streamed path gives None; we give None for both.
- Separator newlines (rule 4): vLLM keeps the "\\n" after "</think>" in content and the "\\n\\n"
  before an implicit "<tool_call>" end in reasoning; we drop them.
- Text before "<think>" in a block that starts open (deepseek_r1 "\\n<think>R</think>"): vLLM's
  non-streamed path drops it and its streamed path keeps it as reasoning; we keep it as reasoning
  (rule 3; this one is a newline, dropped by rule 4).

Left out on purpose: gpt-oss Harmony (channels, not a marker pair: several analysis messages, a
commentary channel with tool calls and preambles), Kimi K3 XTML (<|open|>think<|sep|> with
response and message wrappers to strip), Granite (plain-text headings, not tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "FORMATS",
    "ReasoningFormat",
    "ReasoningParser",
    "detect",
    "get_format",
    "parse",
    "prompt_opens_thinking",
]

_NL = "\r\n"  # the separator characters of rule 4
_PROMPT_TAIL_TOKENS = 32  # prompt_opens_thinking decodes only this many trailing prompt ids


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """One think-marker convention. `implicit_ends`: (opener, follow) pairs; reasoning ends at
    `opener` when `follow` comes next after optional whitespace ("" = at once), and the opener is
    content. `tokens`: the vocabulary entries that identify the format for `detect()`, by default
    the two markers."""

    name: str
    start: str
    end: str
    bare: str  # "reasoning" | "content": output without markers, when the prompt state is unknown
    tokens: tuple[str, ...] = ()  # () = (start, end)
    implicit_ends: tuple[tuple[str, str], ...] = ()
    models: str = ""


# In detect() precedence: specific pairs first, then the <think> family from the most to the least
# specific vocabulary fingerprint. Command R/A content keeps its <|START_RESPONSE|> / <|START_ACTION|>
# blocks for the content and tool parsers.
_DS_ASSISTANT = "<\uff5cAssistant\uff5c>"  # DeepSeek's full-width bars
_KIMI_TOOLS = "<|tool_calls_section_begin|>"
FORMATS: dict[str, ReasoningFormat] = {
    f.name: f
    for f in (
        ReasoningFormat("seed_oss", "<seed:think>", "</seed:think>", "reasoning", models="Seed-OSS"),
        ReasoningFormat(
            "command_r", "<|START_THINKING|>", "<|END_THINKING|>", "content", models="Command R7B, Command A"
        ),
        ReasoningFormat("mistral", "[THINK]", "[/THINK]", "content", models="Magistral 2507+, Ministral-3"),
        ReasoningFormat(
            "gemma4",
            "<|channel>thought",
            "<channel|>",
            "content",
            ("<|channel>", "<channel|>"),
            models="Gemma 4",
        ),
        ReasoningFormat(
            "kimi", "\u25c1think\u25b7", "\u25c1/think\u25b7", "content", models="Kimi-VL Thinking"
        ),
        ReasoningFormat(
            "deepseek_r1",
            "<think>",
            "</think>",
            "reasoning",
            ("<think>", "</think>", _DS_ASSISTANT),
            models="DeepSeek-R1 and its distills, V3.1+",
        ),
        ReasoningFormat(
            "kimi_k2",
            "<think>",
            "</think>",
            "reasoning",
            ("<think>", "</think>", _KIMI_TOOLS),
            ((_KIMI_TOOLS, ""),),
            models="Kimi K2 thinking",
        ),
        ReasoningFormat(
            "qwen3",
            "<think>",
            "</think>",
            "reasoning",
            ("<think>", "</think>", "<|im_start|>"),
            (("<tool_call>", "<function"),),
            models="Qwen3, Qwen3.5+, QwQ",
        ),
        ReasoningFormat(
            "think", "<think>", "</think>", "content", models="GLM-4.5+, MiniMax, Magistral-2506"
        ),
    )
}
_ALIASES = {"glm45": "think", "glm4_moe": "think", "seedoss": "seed_oss", "cohere": "command_r"}


def get_format(fmt: str | ReasoningFormat) -> ReasoningFormat:
    """A format by name (`--reasoning-parser`; "-" and "_" are the same) or the format itself."""
    if isinstance(fmt, ReasoningFormat):
        return fmt
    key = fmt.strip().lower().replace("-", "_")
    found = FORMATS.get(_ALIASES.get(key, key))
    if found is None:
        raise ValueError(f"unknown reasoning format {fmt!r}; known: {', '.join(FORMATS)}")
    return found


def _vocabulary(tokenizer_or_vocab) -> Mapping | set:
    if isinstance(tokenizer_or_vocab, Mapping):
        return tokenizer_or_vocab
    get_vocab = getattr(tokenizer_or_vocab, "get_vocab", None)
    if not callable(get_vocab):
        return set(tokenizer_or_vocab)
    names = set(get_vocab())
    names.update(getattr(tokenizer_or_vocab, "all_special_tokens", None) or ())
    added = getattr(tokenizer_or_vocab, "added_tokens_decoder", None) or {}
    names.update(str(getattr(t, "content", t)) for t in added.values())
    return names


def detect(tokenizer_or_vocab) -> str | None:
    """The format whose marker tokens the vocabulary has, or None. Takes a tokenizer (anything with
    `get_vocab()`), a token->id mapping, or an iterable of token strings. The vocabulary says which
    markers exist, not whether the model thinks: a non-thinking model sharing a thinking model's
    tokenizer (Qwen3-Instruct-2507) detects as qwen3, and its prompt (`prompt_opens_thinking`
    False) keeps its output content."""
    vocab = _vocabulary(tokenizer_or_vocab)
    for f in FORMATS.values():
        if all(t in vocab for t in f.tokens or (f.start, f.end)):
            return f.name
    return None


def prompt_opens_thinking(prompt: str | Sequence[int], fmt: str | ReasoningFormat, tokenizer=None) -> bool:
    """Whether the rendered prompt ends inside an opened think block: after trailing whitespace, it
    ends with the start marker ("...assistant\\n<think>\\n"). A prompt whose template closed the
    block ("<think>\\n\\n</think>\\n\\n", "<｜Assistant｜></think>") does not. Token ids need
    `tokenizer` (with `decode`); only the last few ids are decoded."""
    f = get_format(fmt)
    if not isinstance(prompt, str):
        if tokenizer is None:
            raise TypeError("prompt token ids need a tokenizer to decode them")
        prompt = tokenizer.decode(list(prompt)[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return prompt.rstrip().endswith(f.start)


def _partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of a marker (0 if none)."""
    markers = tuple(markers)
    for k in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-k:]
        if any(len(m) > k and m.startswith(tail) for m in markers):
            return k
    return 0


_PASS, _BEFORE, _REASONING, _CONTENT = "pass", "before", "reasoning", "content"


class ReasoningParser:
    """Per-request incremental splitter: `feed(delta)` and `finish()` return (reasoning, content)
    deltas ("" when none). State for the engine: `in_reasoning` (inside the block now), `ended`
    (the block was closed, by its end marker or an implicit end), `reasoning_chars` (characters of
    reasoning emitted), `pending` (text held back, not yet emitted)."""

    def __init__(
        self, fmt: str | ReasoningFormat, *, thinking: bool = True, prompt_opened: bool | None = None
    ):
        self.format = f = get_format(fmt)
        if prompt_opened:
            state = _REASONING
        elif not thinking:
            state = _PASS
        elif prompt_opened is None and f.bare == "reasoning":
            state = _REASONING
        else:
            state = _BEFORE
        self._state = state
        self._follow = dict(f.implicit_ends)
        self._inside_markers = (f.end, f.start, *self._follow)
        self._buf = ""  # unprocessed text: a possible partial marker or undecided implicit end
        self._nl = ""  # trailing newlines of the reasoning: a separator if the block ends next
        self._lead = True  # no reasoning emitted yet: leading newlines are separators
        self._content_lead = False  # right after the end marker: leading newlines are separators
        self._content_started = False
        self._finished = False
        self.ended = False
        self.reasoning_chars = 0

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING

    @property
    def pending(self) -> str:
        return self._nl + self._buf

    def feed(self, text: str) -> tuple[str, str]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._state == _PASS:
            return "", text
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf and self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: held text is flushed as text of the part it was in."""
        if self._finished:
            return "", ""
        self._finished = True
        buf, self._buf = self._buf, ""
        if self._state == _BEFORE:
            return "", buf
        if self._state == _REASONING:
            out: list[str] = []
            self._reason(buf, out)
            self._nl = ""  # the block ends here: trailing newlines are a separator (rule 4)
            return "".join(out), ""
        return "", buf

    # -- one step of the state machine; False when it must wait for more text --

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        if self._state == _BEFORE:
            return self._step_before(content)
        if self._state == _REASONING:
            return self._step_reasoning(reasoning)
        text, self._buf = self._buf, ""
        if self._content_lead:
            text = text.lstrip(_NL)
            if text:
                self._content_lead = False
        content.append(text)
        return False

    def _step_before(self, content: list[str]) -> bool:
        buf, start = self._buf, self.format.start
        i = buf.find(start)
        if i >= 0:
            pre = buf[:i]
            if self._content_started or pre.strip():
                content.append(pre)
                self._content_started = True
            self._buf = buf[i + len(start) :]
            self._state = _REASONING
            return True
        emit = buf[: len(buf) - _partial_suffix(buf, (start,))]
        if not self._content_started and not emit.strip():
            return False  # only whitespace so far: dropped if a start marker follows (rule 3)
        if emit:
            content.append(emit)
            self._content_started = True
            self._buf = buf[len(emit) :]
        return False

    def _step_reasoning(self, reasoning: list[str]) -> bool:
        buf, f = self._buf, self.format
        found = [(j, m) for m in self._inside_markers if (j := buf.find(m)) >= 0]
        if not found:
            keep = _partial_suffix(buf, self._inside_markers)
            self._reason(buf[: len(buf) - keep], reasoning)
            self._buf = buf[len(buf) - keep :]
            return False
        j, marker = min(found)
        if marker == f.end:
            self._reason(buf[:j], reasoning)
            self._close(buf[j + len(marker) :], content_lead=True)
            return True
        if marker == f.start:  # a re-opened block: the marker is dropped (rule 3)
            self._reason(buf[:j], reasoning)
            self._buf = buf[j + len(marker) :]
            return True
        follow = self._follow[marker]
        rest = buf[j + len(marker) :].lstrip()
        if rest.startswith(follow):  # an implicit end: the opener is content (rule 5)
            self._reason(buf[:j], reasoning)
            self._close(buf[j:], content_lead=False)
            return True
        if follow.startswith(rest):  # undecided until more text comes
            self._reason(buf[:j], reasoning)
            self._buf = buf[j:]
            return False
        self._reason(buf[: j + len(marker)], reasoning)  # just a mention: reasoning text
        self._buf = buf[j + len(marker) :]
        return True

    def _close(self, rest: str, *, content_lead: bool) -> None:
        self._nl = ""
        self._buf = rest
        self._state = _CONTENT
        self._content_lead = content_lead
        self.ended = True

    def _reason(self, text: str, out: list[str]) -> None:
        """Emit reasoning text, dropping leading newlines of the block and holding trailing ones."""
        if self._lead:
            text = text.lstrip(_NL)
        if not text:
            return
        text = self._nl + text
        body = text.rstrip(_NL)
        self._nl = text[len(body) :]
        if body:
            self._lead = False
            self.reasoning_chars += len(body)
            out.append(body)


def parse(
    text: str, fmt: str | ReasoningFormat, *, thinking: bool = True, prompt_opened: bool | None = None
) -> tuple[str | None, str | None]:
    """One-shot split of a whole output: (reasoning, content), None for an empty part."""
    parser = ReasoningParser(fmt, thinking=thinking, prompt_opened=prompt_opened)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2) or None, (c1 + c2) or None
