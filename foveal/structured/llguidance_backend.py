"""The llguidance grammar backend (PyPI `llguidance`): OutputConstraint -> compiled grammar -> matchers.

llguidance works on bytes over the tokenizer's whole vocabulary, so any tokenization of allowed text is
accepted (masks offer text the grammar forces, like the rest of an enum value, in its canonical tokens
only); JSON schemas, regexes, choices and Lark grammars all become one Earley grammar over a lazily
built lexer DFA. Every EOS id given to from_tokenizer is allowed exactly when the grammar may end.
A bad schema, regex or grammar puts the `LLMatcher` in an error state instead of raising: compile()
turns that into a ValueError. Compiling builds a template matcher and computes its first mask (so the
lexer's first states are built in the compiling thread); each request's matcher is a deep copy of it
(microseconds), which shares the template's lexer.

Threads (llguidance 1.9): the tokenizer and compiled grammars may be shared; a matcher is used by one
thread at a time. Grammar construction and mask computation release the GIL. Errors are built with
`verbose_errors=False`: a verbose one quotes the grammar and parser state into logs and responses.

Limits: each mask or token step may spend `step_lexer_fuel` (default 200k, ~10 ms) building lexer
states. Step by step (a mask, then a token) no maskbench schema ran out of it, but accepting hundreds of
tokens in one call can, which breaks the *shared* lexer (see LLGuidanceGrammar).

Compiling is where a hostile grammar does its damage, so it is fenced three ways: size limits checked
before llguidance sees the text (limits.py: a 400 in microseconds); the native work on threads with a
256 MiB stack (a Lark chain of 3,000 rules overflowed an 8 MiB one, killing the process), waited for
`compile_timeout` seconds at most; and a first step taken on a copy (mask, one allowed token, the next
mask), since a grammar over a parser limit compiles and then fails at its first token. A worker process
would also survive a native crash we do not know of, but the compiled grammar cannot leave it: every
grammar would be compiled twice, in it and here; benchmarks/grammar_isolation.py measures both.

It must not know about requests or the engine; it needs a Hugging Face fast tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
from collections.abc import Iterable, Sequence

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher, LLParserLimits

from foveal.structured import limits as size_limits
from foveal.structured.bitmask import bitmask_words, unpack_bitmask
from foveal.structured.constraint import OutputConstraint

log = logging.getLogger(__name__)

_ANY_OBJECT = '{"type":"object"}'
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")
_LARK_START = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")
_WHAT = {
    "json_schema": "JSON schema",
    "json_object": "JSON schema",
    "regex": "regex",
    "choice": "choice",
    "lark": "grammar",
}


COMPILE_STACK_BYTES = 256 * 2**20
_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
_STACK_LOCK = threading.Lock()


def on_compile_thread(fn, timeout: float):
    """fn() on a compile thread (256 MiB stack), waiting `timeout` s at most: past it, a ValueError
    (the compile runs on and its result is dropped; two threads, so runaways cannot pile up more)."""
    with _STACK_LOCK:  # the pool starts its threads inside submit(): with the stack size set here
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            future = _POOL.submit(fn)
        finally:
            threading.stack_size(old)
    try:
        return future.result(timeout)
    except concurrent.futures.TimeoutError:
        raise ValueError(f"the grammar did not compile within {timeout:g} s") from None


def _ll_tokenizer(hf_tokenizer, vocab_size: int | None, eos: list[int] | None) -> llguidance.LLTokenizer:
    """llguidance.hf.from_tokenizer, without its copy of the Rust tokenizer where nothing needs changing:
    it copies to turn padding and truncation off, and the copy (a round trip through JSON) took 0.23 s
    of the 0.85 s on the Zen 3 host, the GIL held."""
    bt = getattr(hf_tokenizer, "backend_tokenizer", None)
    if bt is None or bt.padding is not None or bt.truncation is not None:
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
    if eos is None:
        eos = hf_tokenizer.eos_token_id
    return llguidance.LLTokenizer(bt.to_str(), n_vocab=vocab_size, eos_token=eos)


def grammar_nbytes(text: str) -> int:
    """The memory a compiled grammar holds, estimated from its definition's length: a fixed part (the
    template matcher, the lexer's first states) and a part that grows with the grammar. Measured with
    benchmarks/grammar_isolation.py: choice lists of 30 and 300 KB held 9-12 resident bytes per byte,
    12-field schemas less than 5; the estimate errs high."""
    return _BASE_BYTES + _BYTES_PER_BYTE * len(text)


_BASE_BYTES, _BYTES_PER_BYTE = 64 * 1024, 16


def _clean(msg: str) -> str:
    return msg.replace("<non-verbose/>", "").strip()


# llguidance errors that name its internals, in words
_OPAQUE = {
    "NoExtensionBias": "a $ref cycle that no finite JSON document satisfies (a definition that can only "
    "refer to itself)",
}


def _compile_error(kind: str, msg: str) -> str:
    msg = _clean(msg)
    msg = _OPAQUE.get(msg, msg)
    if kind == "regex":  # llguidance quotes the Lark rule `start: /.../` it wrapped the regex in: drop it
        msg = msg[msg.find("regex parse error") :] if "regex parse error" in msg else msg
        lines = msg.splitlines()
        cut = next((i for i, line in enumerate(lines) if line.lstrip().startswith("1 | start:")), len(lines))
        msg = "\n".join(lines[:cut]).rstrip()
    return f"invalid {_WHAT[kind]}: {msg}"


class LLGuidanceMatcher:
    """One request's llguidance matcher (see foveal.structured.backend.Matcher)."""

    __slots__ = ("_m", "_n", "_grammar", "_eos_unrecorded")

    def __init__(self, m: LLMatcher, grammar: LLGuidanceGrammar):
        self._m, self._n, self._grammar = m, 0, grammar
        # EOS taken by an already stopped matcher is not in llguidance's history: rollback must skip it
        self._eos_unrecorded = False

    def fill_bitmask(self, row: torch.Tensor) -> None:
        words = self._grammar.words
        if row.dtype != torch.int32 or row.device.type != "cpu" or row.numel() != words:
            raise ValueError(f"bitmask row must be a CPU int32 tensor of {words} words")
        if not row.is_contiguous():
            raise ValueError("bitmask row must be contiguous")
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        if self._m.is_error():
            self._grammar.matcher_failed(self._m.get_error())

    def accept(self, token_ids: Sequence[int]) -> bool:
        ids = list(token_ids)
        n = self._m.try_consume_tokens(ids)
        # try_consume_tokens stops before EOS; EOS is accepted (last) where the grammar may end
        if n == len(ids) - 1 and ids[n] in self._grammar.eos and self._m.is_accepting():
            stopped = self._m.is_stopped()
            if self._m.consume_token(ids[n]):
                n += 1
                self._eos_unrecorded = stopped
        if n < len(ids):
            # under a mask this does not happen, unless the shared lexer ran out of fuel (see above)
            self._grammar.matcher_failed(self._m.get_error() if self._m.is_error() else "")
            if n:
                self._rollback(n)
            return False
        self._n += n
        return True

    def validate(self, token_ids: Sequence[int]) -> int:
        return self._m.validate_tokens(list(token_ids))

    def forced(self) -> list[int]:
        return self._m.compute_ff_tokens()

    def copy(self) -> LLGuidanceMatcher:
        c = LLGuidanceMatcher(self._m.deep_copy(), self._grammar)
        c._n, c._eos_unrecorded = self._n, self._eos_unrecorded
        return c

    def unwritable(self) -> str | None:
        forced = self._m.compute_ff_bytes()
        if forced and forced[0] not in self._grammar.backend.lead_bytes:
            return (
                f"the grammar requires the byte 0x{forced[0]:02x} next (in {forced[:8]!r}), which no token "
                "of this model's vocabulary can write"
            )
        return None

    def rollback(self, k: int) -> None:
        if not 0 <= k <= self._n:  # llguidance would enter its sticky error state instead
            raise ValueError(f"cannot roll back {k} tokens: {self._n} accepted")
        self._rollback(k)
        self._n -= k

    def _rollback(self, k: int) -> None:
        if k and self._eos_unrecorded:
            k, self._eos_unrecorded = k - 1, False
        if k and not self._m.rollback(k):
            raise RuntimeError(f"llguidance rollback failed: {_clean(self._m.get_error())}")

    def reset(self) -> None:
        self.rollback(self._n)

    def is_terminated(self) -> bool:
        return self._m.is_stopped() and not self._m.is_error()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def num_tokens(self) -> int:
        return self._n

    @property
    def error(self) -> str | None:
        return _clean(self._m.get_error()) if self._m.is_error() else None


class LLGuidanceGrammar:
    """A compiled grammar: a template matcher that each request's matcher is a deep copy of. Copies
    share the template's lexer (its DFA cache, so later requests find states built), and with it the
    lexer's error: when one step runs out of `step_lexer_fuel`, the shared lexer stays broken and every
    later copy fails at its first token. So a matcher that runs out of fuel, or refuses a token, marks
    the grammar stale, and the next matcher() builds a fresh template (~1 ms): one request's bad luck is
    not every later request's. Matchers copied before that share the broken lexer and may fail too.
    Any other error is the grammar's own (a parser row over its limit, too many lexer expressions): it
    comes back on every retry, so `failure` records it and the cache refuses the spec from then on."""

    __slots__ = (
        "spec", "warnings", "words", "eos", "backend", "failure", "nbytes", "_build", "_template", "_stale",
        "_lock", "__weakref__",
    )  # fmt: skip

    def __init__(self, spec: OutputConstraint, build, words: int, eos: frozenset[int]):
        self.spec, self.words, self.eos, self._build = spec, words, eos, build
        self.backend = None
        self.failure: str | None = None
        self.nbytes = 0  # set by the backend
        self._template = build()
        self.warnings = tuple(self._template.get_grammar_warnings())
        self._stale = False
        self._lock = threading.Lock()

    def matcher_failed(self, error: str) -> None:
        """A matcher of this grammar erred (or refused a token: error "")."""
        if not error or "fuel" in error:
            self._stale = True
        elif self.failure is None:
            self.failure = _clean(error)

    def matcher(self) -> LLGuidanceMatcher:
        with self._lock:
            if self._stale:
                self._template, self._stale = self._build(), False
                log.info("grammar %s: rebuilt its template after a matcher failed", self.spec.digest()[:12])
            m = self._template.deep_copy()
        return LLGuidanceMatcher(m, self)


class LLGuidanceBackend:
    """GrammarBackend on llguidance. Build it with `from_tokenizer` (0.6 s for SmolLM2's 49k vocabulary on
    the 2-vCPU Zen 3 host, every other thread stopped: llguidance holds the GIL; a server builds it before
    it serves, InputProcessor.prepare_grammars); `vocab_size` is the bitmask width, which may exceed
    the tokenizer's (the model's padded LM head): ids past the tokenizer are never allowed."""

    name = "llguidance"

    def __init__(
        self,
        ll_tokenizer: llguidance.LLTokenizer,
        limits: LLParserLimits | None = None,
        *,
        size_limits: size_limits.GrammarLimits = size_limits.DEFAULT,
        compile_timeout: float = 10.0,
    ):
        self.tokenizer = ll_tokenizer
        self.vocab_size: int = ll_tokenizer.vocab_size
        self.eos_token_ids = frozenset(ll_tokenizer.eos_tokens)
        self.limits = limits or LLParserLimits(verbose_errors=False)
        self.size_limits = size_limits
        self.compile_timeout = compile_timeout
        self._words = bitmask_words(self.vocab_size)
        self._executor: llguidance.LLExecutor | None = None
        self._executor_lock = threading.Lock()
        self._byte_tokens: dict[int, int] | None = None
        self._lead_bytes: frozenset[int] | None = None

    @property
    def lead_bytes(self) -> frozenset[int]:
        """The bytes some token of the vocabulary starts with (a grammar that requires another one
        cannot be written: llguidance's mask then offers the byte after it, which it refuses)."""
        if self._lead_bytes is None:
            tok = self.tokenizer
            self._lead_bytes = frozenset(
                b[0]
                for t in range(tok.vocab_size)
                if not tok.is_special_token(t) and (b := tok.decode_bytes([t]))
            )
        return self._lead_bytes

    @property
    def byte_tokens(self) -> dict[int, int]:
        """byte -> a token whose text is exactly that byte (bytes without one are absent); built on
        first use (~20 ms for a 50k vocabulary)."""
        if self._byte_tokens is None:
            tok, found = self.tokenizer, {}
            for t in range(tok.vocab_size):
                if not tok.is_special_token(t):
                    b = tok.decode_bytes([t])
                    if len(b) == 1 and b[0] not in found:
                        found[b[0]] = t
            self._byte_tokens = found
        return self._byte_tokens

    def token_bytes(self, token_ids: Sequence[int]) -> bytes:
        return self.tokenizer.decode_bytes(list(token_ids))

    def tokenize_bytes(self, data: bytes) -> list[int]:
        return self.tokenizer.tokenize_bytes(data)

    @classmethod
    def from_tokenizer(
        cls,
        hf_tokenizer,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        limits: LLParserLimits | None = None,
        **options,
    ) -> LLGuidanceBackend:
        """From a transformers fast tokenizer. vocab_size: the model's logits width (None: the
        tokenizer's; it may not be smaller). eos_token_ids: every id that ends generation (None: the
        tokenizer's eos_token_id); each is allowed exactly when the grammar may end."""
        eos = sorted(set(eos_token_ids)) if eos_token_ids is not None else None
        if eos is not None and not eos:
            raise ValueError("eos_token_ids is empty: a grammar needs a token to end on")
        try:
            tok = _ll_tokenizer(hf_tokenizer, vocab_size, eos)
        except ValueError as e:
            raise ValueError(f"llguidance cannot use this tokenizer: {e}") from None
        return cls(tok, limits, **options)

    def grammar_text(self, spec: OutputConstraint) -> str:
        """The spec as llguidance's grammar definition (a JSON string)."""
        if spec.kind in ("json_schema", "json_object"):
            opts: dict = {}
            if not spec.whitespace_flexible:
                opts["whitespace_flexible"] = False
            if spec.whitespace_pattern is not None:
                opts["whitespace_pattern"] = spec.whitespace_pattern
            if spec.lenient:  # best effort: unknown keywords ignored, oneOf enforced as anyOf
                opts["lenient"] = opts["coerce_one_of"] = True
            schema = spec.value if spec.kind == "json_schema" else _ANY_OBJECT
            return LLMatcher.grammar_from_json_schema(schema, defaults=opts or None)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":  # Lark string literals take JSON's escapes
            choices = json.loads(spec.value)
            # the vocabulary may lack a byte (this GGUF's: 0x04, 0xf2, ...). Text of bytes that each have a
            # token of their own can be written; other text is tokenized and decoded (the round trip took
            # 136 ms of the input pool for 300 KB of choices, which every stream's step felt)
            alone = bytes(sorted(self.byte_tokens))
            for i, c in enumerate(choices):
                data = c.encode()
                if not data.translate(None, alone):
                    continue
                if self.tokenizer.decode_bytes(self.tokenizer.tokenize_bytes(data)) != data:
                    raise ValueError(
                        f"choice {i} ({c[:40]!r}) has text no token of this model's vocabulary writes"
                    )
            alts = " | ".join(json.dumps(c) for c in choices)
            return LLMatcher.grammar_from_lark(f"start: {alts}")
        lark = spec.value
        if _GBNF_RULE.search(lark) and not _LARK_START.search(lark):  # GBNF (`root ::= ...`): convert
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(lark)
            except Exception as e:  # the converter raises its own error types
                raise ValueError(f"invalid grammar (read as GBNF): {e}") from None
        size_limits.check_lark(lark, self.size_limits)
        return LLMatcher.grammar_from_lark(lark)

    def compile(self, spec: OutputConstraint) -> LLGuidanceGrammar:
        if spec.kind != "lark":  # a Lark grammar is checked as Lark, after any GBNF conversion
            size_limits.check(spec, self.size_limits)
        text = self.grammar_text(spec)

        def build() -> LLMatcher:
            m = LLMatcher(self.tokenizer, text, limits=self.limits, log_level=0)
            # a bad spec; or a limit hit at the start or the first token
            error = m.get_error() if m.is_error() else self._first_step(m)
            if error is not None:
                raise ValueError(_compile_error(spec.kind, error))
            return m

        def compile_() -> LLGuidanceGrammar:
            g = LLGuidanceGrammar(spec, build, self._words, self.eos_token_ids)
            g._build = lambda: on_compile_thread(build, self.compile_timeout)  # a rebuild compiles too
            return g

        g = on_compile_thread(compile_, self.compile_timeout)
        g.nbytes = grammar_nbytes(text)
        g.backend = self  # fills many matchers' masks at once (fill_bitmasks)
        if g.warnings:
            log.info("grammar %s compiled with warnings: %s", spec.digest()[:12], "; ".join(g.warnings))
        return g

    def _first_step(self, m: LLMatcher) -> str | None:
        """The first mask (warming the lexer's first states here, not at a request's first step);
        then, on a copy, one allowed token and the mask after it: a grammar over a parser limit (a row
        of 2,001 alternatives) fails there, not at a request's first token. The error, or None."""
        row = torch.empty(1, self._words, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
        if m.is_error() or m.is_stopped():
            return m.get_error() if m.is_error() else None
        allowed = unpack_bitmask(row, self.vocab_size)[0].nonzero().flatten().tolist()
        token = next((t for t in allowed if t not in self.eos_token_ids), None)
        if token is None:
            return None
        probe = m.deep_copy()
        if probe.consume_token(token) and not probe.is_error():
            probe.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
        return probe.get_error() if probe.is_error() else None

    def fill_bitmasks(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor) -> None:
        """matchers[i] -> bitmask[i], on llguidance's own thread pool (the GIL released)."""
        if not matchers:
            return
        if (
            bitmask.dtype != torch.int32
            or bitmask.device.type != "cpu"
            or bitmask.dim() != 2
            or bitmask.shape[1] != self._words
            or bitmask.shape[0] < len(matchers)
            or not bitmask.is_contiguous()
        ):
            raise ValueError(
                f"bitmask must be a contiguous CPU int32 [rows >= {len(matchers)}, {self._words}]"
            )
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask[0])
            return
        with self._executor_lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
        pairs = [(m._m, i) for i, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), self._words * 4, bitmask.shape[0])
        for m in matchers:
            if m._m.is_error():
                m._grammar.matcher_failed(m._m.get_error())
