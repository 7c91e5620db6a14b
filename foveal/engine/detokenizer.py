"""Incremental detokenization and stop strings for one request: token ids in, final text out.

Owns two hold-backs, applied in this order to each new token:

1. UTF-8. Byte-level BPE (and SentencePiece byte fallback) can split one character across several
   tokens; decoding them one at a time would emit '\ufffd' pieces. We keep two offsets into the ids
   (the TGI/vLLM technique) and decode only the window from `prefix` on:

       ids:   ... | prefix ........ read | held tokens ... end
       text:        prefix_text           new text (emitted once it no longer ends in '\ufffd')

   The prefix gives the decoder context, so the first new token's leading space comes out right
   (SentencePiece strips it at the start of a decode). The first prefix is the prompt's last tokens.
2. Stop strings. Text that could still be the start of a stop string (at most the longest stop
   string's length - 1 characters) is held until it can no longer match; after a match nothing
   more is emitted and `stop_matched` names the string.

Each call decodes a window of a few tokens, never the whole sequence, so the cost per token does
not grow with the output. For a tokenizer that is `tokenizers`' Rust tokenizer underneath (transformers'
TokenizersBackend, decode not overridden) the same windows run in Rust: `tokenizers.decoders.
DecodeStream` (one call a token: ~1.0 us a token through this class against ~2.2 for the windows in
Python, on the embedded model's tokenizer), seeded with the same prompt context; a hold of more than
_MAX_HELD_TOKENS tokens (invalid bytes) hands the request to the Python windows, which cut it.
Tokenizer errors propagate to the caller (the engine turns them into a per-request error). This module
must not import torch or know about the engine's batching.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence

# Prompt tokens used as the first decode prefix, and the prefix kept after it moves.
_CONTEXT_TOKENS = 4
# A real character spans at most 4 byte tokens. Holding more than this many tokens means invalid
# bytes that never complete; then we cut at a token boundary that later tokens cannot change.
_MAX_HELD_TOKENS = 8
# Later bytes can re-read at most 3 bytes before them (the rest of a 4-byte UTF-8 sequence).
_UTF8_LOOKAHEAD = 3
# Ids before the prefix are never read again; drop them once this many pile up.
_TRIM_IDS_AT = 4096
# The Rust windows' tail of ids (flush's and a hand-over's context) is trimmed past this many.
_TAIL_MAX = 64


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, piece by piece.

    The concatenation of everything add() and flush() return equals
    `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    when no stop string matched (for SentencePiece it keeps the first token's leading space, which a
    standalone decode would strip, because the prompt gives context).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        keep_special_token_ids: Sequence[int] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window_decode = _window_decoder(
            tokenizer, skip_special_tokens, frozenset(keep_special_token_ids)
        )
        if isinstance(stop, str):
            stop = [stop]
        self.stop: tuple[str, ...] = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_matched: str | None = None

        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._stop_first_chars = frozenset(s[0] for s in self.stop)
        self._held = ""  # text that may still start a stop string
        self._chunks: list[str] = []
        self._text_cache: str | None = ""

        self._ids: list[int] = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids) if self._ids else ""
        if self._prefix_text.endswith("\ufffd"):
            # The prompt ends inside a character: a prefix that the output's first bytes could
            # complete would make the text diff wrong. Start without context instead.
            self._ids, self._read, self._prefix_text = [], 0, ""
        self._boundaries: list[int] = [0, self._read] if self._read else [0]  # read offsets >= prefix
        # the Rust windows (None: the Python ones above); _tail: the ids fed since the last piece, after
        # the context before them (what flush and the hand-over decode), which starts at a read offset
        # about _CONTEXT_TOKENS back (_marks: the read offsets in _tail), as the Python windows' prefix
        # does; _drop: special ids dropped before decoding (skip_special_tokens with kept ones)
        self._stream, self._rust, self._drop = _decode_stream(
            tokenizer, skip_special_tokens, frozenset(keep_special_token_ids), self._ids
        )
        self._tail, self._marks, self._held_n = list(self._ids), list(self._boundaries), 0

    @property
    def output_text(self) -> str:
        """All text returned so far by add() and flush()."""
        if self._text_cache is None:
            self._text_cache = "".join(self._chunks)
        return self._text_cache

    def add(self, token_ids: Sequence[int]) -> str:
        """Append newly generated token ids; return the text that is now final (may be '')."""
        if self.stop_matched is not None:
            return ""
        out = []
        for token_id in token_ids:
            if self._stream is not None:
                piece = self._stream_piece(int(token_id))
            else:
                self._ids.append(int(token_id))  # the Rust decode takes Python ints only
                piece = self._next_utf8_piece()
            if piece:
                out.append(self._apply_stop(piece) if self.stop else piece)
                if self.stop_matched is not None:
                    break  # tokens after the stop string are never decoded
        return self._record("".join(out))

    def flush(self) -> str:
        """The request ended (EOS/length/abort): return any text still held back.

        Incomplete characters come out as '\ufffd', as in a full decode. Call it once, last.
        """
        if self.stop_matched is not None:
            return ""
        text = ""
        if self._stream is not None and self._held_n:  # the held ids' text, with the context before them
            context = self._tail[: len(self._tail) - self._held_n]
            piece = self._decode(self._tail)[len(self._decode(context)) if context else 0 :]
            self._held_n = 0
            if piece:
                text = self._apply_stop(piece) if self.stop else piece
        elif self._read < len(self._ids):
            new_text = self._decode(self._ids[self._prefix :])
            piece = new_text[len(self._prefix_text) :]
            self._read, self._prefix_text = len(self._ids), new_text
            if piece:
                text = self._apply_stop(piece) if self.stop else piece
        if self.stop_matched is None:
            text += self._held  # a prefix of a stop string that never completed
            self._held = ""
        return self._record(text)

    # -- UTF-8 layer ---------------------------------------------------------------------------

    def _stream_piece(self, token_id: int) -> str:
        """The Rust windows' text made final by this token ('' while held); past _MAX_HELD_TOKENS held,
        the request goes on in the Python windows (their cut included), seeded with the same ids."""
        if token_id in self._drop:
            return ""
        tail = self._tail
        tail.append(token_id)
        piece = self._stream.step(self._rust, token_id)
        if piece is not None:
            self._marks.append(len(tail))
            self._held_n = 0
            if len(tail) > _TAIL_MAX:  # trimmed now and then, not at every piece
                self._trim_tail()
            return piece
        self._held_n += 1
        if self._held_n <= _MAX_HELD_TOKENS:
            return ""
        self._stream = None
        self._ids, self._prefix, self._read = list(tail), 0, len(tail) - self._held_n
        self._prefix_text = self._decode(tail[: self._read]) if self._read else ""
        self._boundaries = [0, self._read] if self._read else [0]
        return self._next_utf8_piece()

    def _trim_tail(self) -> None:
        """Drop the tail's ids before its latest read offset at least _CONTEXT_TOKENS from its end."""
        tail, marks = self._tail, self._marks
        k = len(marks) - 1
        while k > 0 and len(tail) - marks[k] < _CONTEXT_TOKENS:
            k -= 1
        cut = marks[k]
        del tail[:cut]
        self._marks = [m - cut for m in marks[k:]]

    def _decode(self, ids: list[int]) -> str:
        return self._window_decode(ids)

    def _next_utf8_piece(self) -> str:
        """Text made final by the token just appended to self._ids ('' while a character is open)."""
        end = len(self._ids)
        new_text = self._decode(self._ids[self._prefix :])
        if not new_text.endswith("\ufffd"):
            piece = new_text[len(self._prefix_text) :]
            self._advance(end, new_text)
            return piece
        if end - self._read > _MAX_HELD_TOKENS:
            return self._cut_invalid(new_text)
        return ""

    def _advance(self, read: int, prefix_text: str) -> None:
        """Mark ids[:read] as emitted; prefix_text is the decode of ids[self._prefix:read]."""
        self._read, self._prefix_text = read, prefix_text
        self._boundaries.append(read)
        if read - self._prefix <= 2 * _CONTEXT_TOKENS:
            return  # no extra decode: the next window reuses new_text as its prefix text
        # Slide the prefix to an earlier read offset about _CONTEXT_TOKENS back: read offsets are
        # character boundaries, and SentencePiece byte fallback decodes a run of byte tokens
        # all-or-nothing, so a window starting mid-character would garble the next character.
        b = self._boundaries
        k = len(b) - 2  # the previous read offset: always a boundary, maybe little context
        if k <= 0:
            return  # one long jump (a released hold): no boundary to slide to until the next one
        while k > 1 and read - b[k] < _CONTEXT_TOKENS:
            k -= 1
        self._prefix = b[k]
        del b[:k]
        self._prefix_text = self._decode(self._ids[self._prefix : read])
        if self._prefix > _TRIM_IDS_AT:
            shift = self._prefix
            del self._ids[:shift]
            self._read -= shift
            self._boundaries = [x - shift for x in b]
            self._prefix = 0

    def _cut_invalid(self, new_text: str) -> str:
        """Too many held tokens: emit up to the last token boundary that later tokens cannot change.

        For byte-level BPE, k is a character boundary iff decode(a) + decode(b) == decode(a + b) (a
        character or an invalid sequence crossing k decodes to more pieces when split), and with
        >= 3 bytes after k no future byte can re-read anything before k. If no such k exists it is
        not text (a valid character spans at most 4 tokens); emit everything, '\ufffd' included.
        """
        end = len(self._ids)
        for k in range(end - 1, self._read, -1):
            tail = self._decode(self._ids[k:end])
            if len(tail) < _UTF8_LOOKAHEAD:  # every decoded char comes from >= 1 byte
                continue
            head = self._decode(self._ids[self._prefix : k])
            if head + tail == new_text:
                break
        else:
            k, head = end, new_text
        piece = head[len(self._prefix_text) :]
        self._advance(k, head)
        return piece

    # -- stop-string layer ---------------------------------------------------------------------

    def _apply_stop(self, piece: str) -> str:
        """Return the part of held + piece that can no longer be (part of) a stop string."""
        buf = self._held + piece
        # The held text is shorter than any stop string and was no match, so every match ends in
        # the new piece. Take the one that completes first (ties: the longer); that is the one a
        # finer-grained stream would have hit, so the result does not depend on token chunking.
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        if best is not None:
            end, start, s = best
            self.stop_matched = s
            self._held = ""
            return buf[:end] if self.include_stop_str_in_output else buf[:start]
        hold = self._stop_prefix_len(buf)
        self._held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        n = len(buf)
        for p in range(max(0, n - (self._max_stop - 1)), n):
            if buf[p] in self._stop_first_chars:
                tail = buf[p:]
                if any(s.startswith(tail) for s in self.stop):
                    return n - p
        return 0

    def _record(self, text: str) -> str:
        if text:
            self._chunks.append(text)
            self._text_cache = None
        return text


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer) -> frozenset[int]:
    """The ids skip_special_tokens drops: the named specials and every added token marked special."""
    ids = set(tokenizer.all_special_ids)
    ids.update(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    return frozenset(ids)


def _rust_tokenizer(tokenizer):
    """The Rust tokenizer whose decode is exactly tokenizer.decode without clean-up (a TokenizersBackend
    that overrides neither decode nor _decode), else None."""
    fast = sys.modules.get("transformers.tokenization_utils_tokenizers")
    base = sys.modules.get("transformers.tokenization_utils_base")
    backend_cls = getattr(fast, "TokenizersBackend", None)
    base_cls = getattr(base, "PreTrainedTokenizerBase", None)
    cls = type(tokenizer)
    if (
        backend_cls is not None
        and base_cls is not None
        and isinstance(tokenizer, backend_cls)
        and cls._decode is backend_cls._decode
        and cls.decode is base_cls.decode
    ):
        return tokenizer.backend_tokenizer
    return None


def _decode_stream(tokenizer, skip_special_tokens: bool, keep: frozenset[int], context: list[int]):
    """(DecodeStream seeded with the context ids, the Rust tokenizer, the ids to drop before it) where
    the tokenizer allows, else (None, None, empty)."""
    rust = _rust_tokenizer(tokenizer)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # an older tokenizers
        return None, None, frozenset()
    if rust is None:
        return None, None, frozenset()
    drop = _special_ids(tokenizer) - keep if skip_special_tokens and keep else frozenset()
    try:
        stream = DecodeStream(ids=[t for t in context if t not in drop] or None,
                              skip_special_tokens=skip_special_tokens and not keep)  # fmt: skip
    except TypeError:  # a DecodeStream without a context argument
        return None, None, frozenset()
    return stream, rust, drop


def _window_decoder(
    tokenizer, skip_special_tokens: bool, keep: frozenset[int] = frozenset()
) -> Callable[[list[int]], str]:
    """tokenizer.decode without clean-up, or the same call made straight into the Rust tokenizer.
    `keep`: special tokens whose text stays although special tokens are skipped (the markers a
    reasoning or tool-call parser reads): the other special ids are dropped before decoding instead.

    transformers' decode() spends ~3x the Rust decode in Python (type conversion, kwargs); on the
    per-token path we skip that when the class has not overridden decode/_decode, which for
    TokenizersBackend is exactly backend_tokenizer.decode(ids, skip_special_tokens).
    """
    if skip_special_tokens and keep:
        drop = _special_ids(tokenizer) - keep
        plain = _window_decoder(tokenizer, False)
        return lambda ids: plain([t for t in ids if t not in drop])
    rust = _rust_tokenizer(tokenizer)
    if rust is not None:
        rust_decode = rust.decode
        return lambda ids: rust_decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )
