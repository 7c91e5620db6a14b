"""The grammar backend protocol, and the cache of compiled grammars.

A backend turns a OutputConstraint into a CompiledGrammar (slow: milliseconds to seconds, so it runs in the
server's thread pool before admission; a bad schema, regex or grammar is a ValueError naming the
problem). A compiled grammar is shared by every request with that spec; each request gets its own
Matcher from it (cheap: call it in the pool too), which the engine drives one step at a time:

    fill_bitmask(row) -> sample under the mask -> accept([token]) -> ... -> is_terminated()
                                  speculative: validate(drafts) / accept(k) / rollback(k)

Bitmask rows are packed int32 words, bit i of word j = token 32*j + i (1: allowed), `vocab_size`
tokens wide; foveal/structured/bitmask.py allocates and applies them. EOS ids are allowed exactly when
the grammar may end here. A Matcher belongs to one request and is not safe to share between threads;
compiled grammars and the cache are.

GrammarCache keys compiled grammars by spec (its hash, then equality: no collision can swap two
grammars), evicts the least recently used past its entry or byte bound, and compiles each spec once
even when several threads ask at the same time. It must not know which backend it holds.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

import torch

from foveal.structured.constraint import OutputConstraint


class Matcher(Protocol):
    """One request's position in its grammar."""

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row`: a contiguous CPU int32 tensor of
        ceil(vocab_size / 32) words. Stopped or in error: only EOS is allowed."""

    def accept(self, token_ids: Sequence[int]) -> bool:
        """Advance over the tokens, all or none: False (state unchanged) when one is not allowed.
        EOS may come last, where the grammar may end. accept() takes any tokenization of allowed
        text; a mask may be stricter (llguidance offers forced text in its canonical tokens only)."""

    def validate(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens accept() would take (state unchanged): for draft tokens."""

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (the text it allows only one way), [] if none."""

    def copy(self) -> Matcher:
        """An independent matcher at the same position (for a search: closing.py)."""

    def rollback(self, k: int) -> None:
        """Undo the last k accepted tokens (0 <= k <= num_tokens, else ValueError)."""

    def reset(self) -> None:
        """Back to the start (rolls back every token)."""

    def is_terminated(self) -> bool:
        """The grammar is complete: no token but EOS may follow (or EOS was accepted). False in error."""

    def is_accepting(self) -> bool:
        """The output so far is a complete match: EOS is allowed now (more may still follow)."""

    @property
    def num_tokens(self) -> int:
        """Tokens accepted since the start (EOS included): the most that rollback() can undo."""

    def unwritable(self) -> str | None:
        """Why no token can write what the grammar requires next (a byte no token of the vocabulary
        starts with), or None."""

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a resource limit hit by a mask or a token), or None. Sticky: a
        failed matcher only allows EOS and cannot roll back; finish its request with this error."""


class CompiledGrammar(Protocol):
    spec: OutputConstraint
    warnings: tuple[str, ...]  # e.g. keywords a lenient JSON schema had ignored
    backend: GrammarBackend  # the one that compiled it (fill_bitmasks fills many matchers at once)
    # set once a matcher hit a limit of the grammar's own (it would on every retry): the cache then
    # drops it and refuses its spec
    failure: str | None
    nbytes: int  # an estimate of the memory it holds (the cache's byte bound adds these up)

    def matcher(self) -> Matcher:
        """A fresh matcher at the grammar's start (cheap; safe to call from any thread)."""


class GrammarBackend(Protocol):
    name: str
    vocab_size: int  # bitmask width in tokens: ceil(vocab_size / 32) int32 words per row
    eos_token_ids: frozenset[int]

    def compile(self, spec: OutputConstraint) -> CompiledGrammar:
        """Compile (thread-safe, may take seconds); ValueError naming the problem if it is invalid."""

    def fill_bitmasks(self, matchers: Sequence[Matcher], bitmask: torch.Tensor) -> None:
        """matchers[i].fill_bitmask(bitmask[i]) for every i, possibly in parallel."""

    # the vocabulary as bytes, for closing.py
    byte_tokens: dict[int, int]  # byte -> a token of exactly that byte

    def token_bytes(self, token_ids: Sequence[int]) -> bytes: ...

    def tokenize_bytes(self, data: bytes) -> list[int]: ...


@dataclass(frozen=True, slots=True)
class GrammarCacheStats:
    hits: int  # served from the cache (or from a compile another thread had started)
    misses: int  # compiles started
    errors: int  # compiles that raised (never cached: a bad spec is compiled, and refused, each time)
    entries: int
    compile_seconds: float  # total wall time of compiles, failed ones included
    nbytes: int = 0  # the entries' estimated memory (CompiledGrammar.nbytes)
    refused: int = 0  # requests refused for a spec whose grammar failed at run time (`failure`)


class GrammarCache:
    """LRU of compiled grammars, thread-safe; `get` compiles on a miss (outside the lock). Bounded by
    entries and by bytes (each grammar's `nbytes` estimate: a client can send 300 KB choice lists that
    compile to ~30 MiB each). A grammar that failed at run time (`failure`) leaves the cache, and its
    spec is refused from then on (its digest kept, `max_refused` of them)."""

    def __init__(
        self,
        backend: GrammarBackend,
        max_entries: int = 256,
        max_bytes: int = 1 << 30,
        max_refused: int = 4096,
    ):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("max_entries and max_bytes must be at least 1")
        self.backend = backend
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_refused = max_refused
        self._lock = threading.Lock()
        self._entries: OrderedDict[OutputConstraint, CompiledGrammar] = OrderedDict()
        self._nbytes = 0
        self._refused: OrderedDict[str, str] = OrderedDict()  # spec digest -> why
        self._pending: dict[OutputConstraint, Future] = {}
        self._hits = self._misses = self._errors = self._refusals = 0
        self._compile_s = 0.0

    def get(self, spec: OutputConstraint) -> CompiledGrammar:
        with self._lock:
            hit = self._entries.get(spec)
            if hit is not None and hit.failure is not None:
                self._refuse(spec, hit.failure)
                hit = None
            why = self._refused.get(spec.digest()) if self._refused else None
            if why is not None:
                self._refusals += 1
                raise ValueError(f"the grammar exceeded a limit when it ran: {why}")
            if hit is not None:
                self._entries.move_to_end(spec)
                self._hits += 1
                return hit
            pending = self._pending.get(spec)
            if pending is None:
                self._misses += 1
                mine = self._pending[spec] = Future()
            else:
                self._hits += 1
        if pending is not None:  # another thread compiles it: share its result (or its error)
            return pending.result()
        t0 = time.perf_counter()
        try:
            grammar = self.backend.compile(spec)
        except BaseException as e:
            with self._lock:
                self._errors += 1
                self._compile_s += time.perf_counter() - t0
                del self._pending[spec]
            mine.set_exception(e)
            raise
        with self._lock:
            self._compile_s += time.perf_counter() - t0
            del self._pending[spec]
            self._entries[spec] = grammar
            self._nbytes += grammar.nbytes
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or self._nbytes > self.max_bytes
            ):
                self._nbytes -= self._entries.popitem(last=False)[1].nbytes
        mine.set_result(grammar)
        return grammar

    def _refuse(self, spec: OutputConstraint, why: str) -> None:
        self._nbytes -= self._entries.pop(spec).nbytes
        self._refused[spec.digest()] = why
        while len(self._refused) > self.max_refused:
            self._refused.popitem(last=False)

    def __contains__(self, spec: OutputConstraint) -> bool:
        with self._lock:
            return spec in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    def stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(
                self._hits,
                self._misses,
                self._errors,
                len(self._entries),
                self._compile_s,
                self._nbytes,
                self._refusals,
            )
