"""Closing a constrained answer before max_tokens cuts it: a short completion its grammar accepts, found
by searching the matcher's own masks, forced token by token at the end of the budget.

An answer under a grammar that runs into max_tokens otherwise stops mid-structure, JSON that does not
parse (vLLM, SGLang and llama.cpp return it so). Here the Guide (guide.py) asks `Closer.plan` how to
finish from where the answer is, and when the budget left is about that long it forces those tokens:
the answer ends complete and valid, its finish_reason still "length" (it was cut short).

The plan is built over bytes, each a one-byte token of the vocabulary, on a copy of the matcher:
    - text the grammar forces (the rest of a key, an enum value) as it forces it;
    - a closer when the grammar allows one: `"` inside a string, else `}` / `]` (the JSON nesting of
      the text so far, `nesting()`, says which is which);
    - inside a string that may not close yet: a literal of the schema's `pattern`s (`Closer.witnesses`:
      a pattern has search semantics, so `"data:image/png;base64,"` written anywhere lets the string
      close), else a beam search for the nearest state where the string may close;
    - elsewhere (a number, a value to start): a beam search for the nearest closer or comma.
Then the bytes are tokenized by the tokenizer, kept where the matcher takes that shorter form.

The beam search goes by length in bytes; a state is known by its one-byte signature (which probe bytes
it allows), its nesting and how often the signature changed on the way ("progress": a regex's groups
often allow the same next bytes, and without it `iglu:a/` and `iglu:aa` look alike). It is a heuristic:
no plan (None) is an answer, and the request then ends as it would have. Over the maskbench sample with
random prefixes it closes all but schemas whose shortest valid document is thousands of bytes long.

Plans run on the model thread, so each is on a budget (`Budget`): `PLAN_EXPANSIONS` matcher copies
and `PLAN_SECONDS` of the thread's CPU time per plan, and `STEP_SECONDS` for all the plans of one step (the
runner calls `Budget.new_step`); the witnesses a plan reads are built before, in the input pool
(`prepare`). A plan over its budget is given up (None: the request is cut as it
falls, counted in `Budget.skipped`); a look that finds the step's budget spent, or a plan stopped by
what the step's other plans left of it (short of its own limit), is put off to the next step (DEFER).
A schema whose shortest string is 301 characters searched for 6.6 s before this.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from typing import Any

import numpy as np
import torch

from foveal.structured.bitmask import bitmask_words
from foveal.structured.constraint import OutputConstraint

# string content needing no escape, and UTF-8 continuation bytes (the model may stop inside a character;
# which continuations are valid depends on the lead byte, and these five cover every case)
_STRING = bytes(b for b in range(0x20, 0x7F) if b not in b'"\\') + b"\x80\x8f\x90\xa0\xbf"
_VALUE = bytes(range(0x20, 0x7F))  # what a search outside strings tries (by representatives)
_PROBE = b"\"}],:059afgmzAFZ-._/ @+%()!#~'\\"  # the bytes whose validity is a state's signature
_BEAM = 24  # states kept per length
_SEARCH_BYTES = 128  # how far one search looks
_WITNESS_BYTES = 128
MAX_WITNESSES = 16  # patterns of a schema given a witness
WITNESS_SECONDS = 0.050  # and the search for each (with PLAN_EXPANSIONS): Python, so it takes the GIL
# ~11 us an expansion on the 2-vCPU host. A step's plans take at most STEP_SECONDS of the model thread
# (a plan's probes may overrun it by a couple of ms): every other stream's step waits for them. Over the
# maskbench sample at random points (benchmarks/closing.py, SmolLM2's tokenizer, the Zen 5 dev host), a
# plan's p50 is 0.6 ms and p90 2.7 ms; 5 ms a step closes 595 of 645 points, 20 ms closed 621: the
# rest are cut where max_tokens falls, as without closing, and counted (Budget.skipped)
PLAN_SECONDS = 0.005
PLAN_EXPANSIONS = 2_000
STEP_SECONDS = 0.005
POOL_PLAN_SECONDS = 0.050  # a plan from the grammar's start, made in the input pool (prepare), at least
DEFER = "defer"  # plan(): the step's budget is spent, ask again next step


_clock = time.thread_time  # ~1.5 us a read (a syscall), against ~11 us an expansion
# ~0.1 us a read (no syscall). A thread's CPU time grows no faster than the wall clock, so a plan's time
# checks read _clock only once the CPU time last read plus the wall time since could pass the deadline
_wall = time.monotonic


class _OverBudget(Exception):
    pass


class Budget:
    """Time and work the closing plans may take from the model thread (one per process). A plan is
    budgeted between start() and end() on the thread that started it; other work of the search (the
    witnesses, built in the input pool before a request is admitted) is not. Time is the planning
    thread's CPU time (`_clock`): waiting for the GIL or a core is not the plan's cost, and counting it
    gave up a 2-3 ms plan on a busy 2-vCPU host (the answer then cut, not closed, by the host's load)."""

    def __init__(
        self, plan_s: float = PLAN_SECONDS, expansions: int = PLAN_EXPANSIONS, step_s: float = STEP_SECONDS
    ):
        self.plan_s, self.expansions, self.step_s = plan_s, expansions, step_s
        self.step_spent = 0.0
        self.skipped = 0  # plans given up over budget (lifetime)
        self._plan = threading.local()  # t0, deadline, left: set while this thread plans

    def new_step(self) -> None:
        self.step_spent = 0.0

    def start(self, on_step: bool = True) -> bool:
        """Begin a plan; False when this step's budget is spent. on_step False: a plan of the input
        pool (prepare), on its own time limit (POOL_PLAN_SECONDS, or a plan's if longer) and not the
        model thread's step budget."""
        if on_step and self.step_spent >= self.step_s:
            return False
        p = self._plan
        p.wall = _wall()  # before the CPU time: the bound `_over` keeps is then never below it
        p.t0 = p.cpu = _clock()
        if on_step:
            p.deadline = p.t0 + min(self.plan_s, self.step_s - self.step_spent)
            p.short = self.step_s - self.step_spent < self.plan_s  # the step's time left is the limit
        else:
            p.deadline = p.t0 + max(self.plan_s, POOL_PLAN_SECONDS)
            p.short = False
        p.left = self.expansions
        p.on_step = on_step
        return True

    def spend(self) -> None:
        """One matcher copy or probe; _OverBudget past the plan's limits (nothing outside a plan)."""
        p = self._plan
        if getattr(p, "left", None) is None:
            return
        p.left -= 1
        if p.left < 0 or self._over(p):
            raise _OverBudget

    def check(self) -> None:
        """The plan's time only (inside an expansion: its probes can cost milliseconds each while a
        lexer builds the states of a long counted repetition)."""
        p = self._plan
        if getattr(p, "left", None) is not None and self._over(p):
            raise _OverBudget

    @staticmethod
    def _over(p) -> bool:
        """Whether the plan's CPU time is past its deadline, the clock (a syscall) read only when it may
        be: a search checks before every probe, and reading it each time took ~10% of a plan's time."""
        w = _wall()
        if p.cpu + (w - p.wall) <= p.deadline:
            return False
        p.wall = w
        p.cpu = _clock()
        return p.cpu > p.deadline

    def cut_by_step(self) -> bool:
        """Whether the plan that just went over its budget was stopped by the step's time left, short of
        its own limit: the other plans of the step took the rest, so it is put off to the next step
        rather than given up (a plan over its own time or expansions is given up)."""
        p = self._plan
        return p.short and p.left >= 0

    def end(self, skipped: bool) -> None:
        p = self._plan
        if p.on_step:
            self.step_spent += _clock() - p.t0
        self.skipped += skipped
        p.left = None


BUDGET = Budget()


def nesting(stack: str, data: bytes) -> str:
    """The JSON nesting after `data`, from `stack` before it: `{` / `[` per open container, `"` inside
    a string, a last `\\` while an escape is pending. Text that is not JSON just nests oddly: the
    plan reads it as a hint only."""
    s = list(stack)
    esc = bool(s) and s[-1] == "\\"
    if esc:
        s.pop()
    for b in data:
        if s and s[-1] == '"':
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                s.pop()
        elif b in (0x7B, 0x5B):
            s.append(chr(b))
        elif b in (0x7D, 0x5D):
            if s:
                s.pop()
        elif b == 0x22:
            s.append('"')
    return "".join(s) + ("\\" if esc else "")


def _in_string(stack: str) -> bool:
    return stack.endswith('"') or stack.endswith("\\")


def _patterns(spec: OutputConstraint) -> list[str]:
    """The regexes a JSON schema puts on strings: `pattern` values and `patternProperties` keys."""
    if spec.kind != "json_schema":
        return []
    found: dict[str, None] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for k, v in x.items():
                if k == "pattern" and isinstance(v, str):
                    found[v] = None
                elif k == "patternProperties" and isinstance(v, dict):
                    found.update(dict.fromkeys(p for p in v if isinstance(p, str)))
                    walk(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(spec.value))
    return list(found)


class Closer:
    """Plans the end of answers under one compiled grammar; shared by its requests (thread-safe: a
    plan works on copies, the witnesses are built once under a lock)."""

    def __init__(self, grammar):
        # not the grammar itself: _CLOSERS holds this weakly keyed by it, and a value that refers to its
        # key keeps it alive (every grammar with a Closer stayed in memory past its cache eviction)
        self.spec = grammar.spec
        backend = grammar.backend
        self._backend = backend
        self._byte = backend.byte_tokens  # byte -> a token of exactly that byte
        self._words = bitmask_words(backend.vocab_size)
        self._cost: dict[bytes, list] = {}  # per search alphabet: how its states' probes are read (_Bits)
        self._bytes: dict[int, bytes] = {}
        self._witnesses: list[list[int]] | None = None
        self._lock = threading.Lock()
        self._start: tuple[int, list[int] | None] = (0, None)  # (limit tried, plan) from the start

    def text(self, tokens) -> bytes:
        """The tokens' text (each token's bytes decoded once per grammar, then kept)."""
        out = []
        for t in tokens:
            b = self._bytes.get(t)
            if b is None:
                b = self._bytes[t] = self._backend.token_bytes([t])
            out.append(b)
        return b"".join(out)

    def _ok(self, m, b: int) -> bool:
        t = self._byte.get(b)
        if t is None:
            return False
        BUDGET.check()
        return m.validate([t]) == 1

    # -- the plan -----------------------------------------------------------------------------------
    def plan(self, matcher, stack: str, limit: int, on_step: bool = True) -> list[int] | None | str:
        """Tokens (at most `limit`) that take `matcher` from where it is to a complete match, None
        when none was found within the budget, or DEFER when this step's budget is spent (before the
        plan, or during it short of the plan's own limit). `stack`: the JSON nesting of the text so far
        (`nesting`). From the grammar's start (the shortest document) the answer is the same for every
        request: kept, and so is a search given up (`prepare` makes it in the input pool, so a
        request's first look costs the model thread nothing)."""
        if matcher.num_tokens == 0:
            with self._lock:
                tried, plan = self._start
            if plan is not None:
                return plan if len(plan) <= limit else None
            if limit <= tried:
                return None
            plan = self._budgeted(matcher, stack, limit, on_step)
            if plan is DEFER:
                return plan
            with self._lock:
                self._start = (max(limit, self._start[0]), plan) if plan is not None else (limit, None)
            return plan
        return self._budgeted(matcher, stack, limit)

    def _budgeted(self, matcher, stack: str, limit: int, on_step: bool = True):
        if not BUDGET.start(on_step):
            return DEFER
        try:
            plan = self._plan(matcher, stack, limit)
        except _OverBudget:
            later = BUDGET.cut_by_step()
            BUDGET.end(skipped=not later)
            return DEFER if later else None
        BUDGET.end(skipped=False)
        return plan

    def _plan(self, matcher, stack: str, limit: int) -> list[int] | None:
        m = matcher.copy()
        out: list[int] = []
        cap = 2 * limit + 16  # tokens: the tokenizer's merges shorten one-byte ones afterwards
        quote = self._byte.get(0x22)
        while not m.is_accepting():
            if len(out) > cap or m.error is not None:
                return None
            forced = m.forced()
            if forced:
                path = [forced]
            else:
                path = self._next(m, stack, quote)
                if path is None:
                    return None
            for e in path:
                if not m.accept(e):
                    return None
                out += e
                stack = nesting(stack, self.text(e))
        if len(out) > 1:
            short = self._backend.tokenize_bytes(self.text(out))
            if len(short) < len(out) and matcher.validate(short) == len(short):
                out = short
        return out if len(out) <= limit else None

    def _next(self, m, stack: str, quote: int | None) -> list[list[int]] | None:
        """The next steps of a plan: a closer, a pattern's literal, or a searched path."""
        if _in_string(stack):
            if not stack.endswith("\\") and self._ok(m, 0x22):
                return [[quote]]
            if quote is not None and not stack.endswith("\\"):
                for w in self.built_witnesses():
                    if m.validate(w + [quote]) == len(w) + 1:
                        return [w]
            depth = len(stack.rstrip("\\"))

            def goal(d, s: str) -> bool:  # the string may close now, or it closed
                inner = s.rstrip("\\")
                return d.is_accepting() or len(inner) < depth or (not s.endswith("\\") and self._ok(d, 0x22))

            return self._search(m, stack, goal, _STRING, self.built_witnesses())
        # close, open a string (a key, a value), or go on to a container's next item
        for b in b'}]",' if stack else b'}]"':
            if self._ok(m, b):
                return [[self._byte[b]]]
        depth = len(stack)

        def goal(d, s: str) -> bool:  # something closes, or a comma or string may follow
            return d.is_accepting() or len(s) != depth or any(self._ok(d, b) for b in b'}],"')

        return self._search(m, stack, goal, _VALUE, [])

    def _search(
        self,
        m,
        stack: str,
        goal,
        alphabet: bytes,
        witnesses,
        limit: int = _SEARCH_BYTES,
        budget=None,
        cost=None,
    ):
        """A beam search by length in bytes for the shortest path (a list of token lists) to a state
        where `goal(matcher, nesting)` holds, or after which a witness and `"` may follow; None if
        there is none within `limit` bytes. Each expansion spends from `budget` (default: BUDGET).
        cost: how the states' probes are read (_Bits; default: this grammar's for the alphabet)."""
        budget = budget or BUDGET
        quote = self._byte.get(0x22)
        letters = [b for b in alphabet if b in self._byte]
        probe = [self._byte[b] for b in _PROBE if b in self._byte]
        cost = self._cost.setdefault(alphabet, [0, 0.0, 0.0]) if cost is None else cost
        bits = _Bits(self._words, probe, [self._byte[b] for b in letters], cost, budget)
        layers: dict[int, list] = {0: [(stack, m, [], 0, None)]}
        while layers:
            n = min(layers)
            if n > limit:
                return None
            layer = layers.pop(n)
            for _, d, path, _, _ in layer:  # a complete match first
                if path and d.is_accepting():
                    return path
            fresh, repeats, seen = [], [], set()
            for s, d, path, progress, before in layer:
                if path and goal(d, s):
                    return path
                budget.spend()
                forced = d.forced()
                if forced:
                    sig, ok = ("forced", tuple(forced)), ()
                else:
                    sig, ok = bits.read(d)
                progress += sig != before
                key = (sig, s, progress)
                (repeats if key in seen else fresh).append((s, d, path, forced, progress, sig, ok))
                seen.add(key)
            fresh.sort(key=lambda x: -x[4])
            for s, d, path, forced, progress, sig, ok in (fresh + repeats)[:_BEAM]:
                if forced:
                    edges = [forced]
                else:
                    allowed = [b for b, y in zip(letters, ok) if y]
                    edges = [[self._byte[b]] for b in _representatives(allowed)]
                    for w in witnesses if quote is not None else ():  # a literal that lets the string close
                        if d.validate(w + [quote]) == len(w) + 1:
                            return path + [w]
                for e in edges:
                    budget.spend()
                    x = d.copy()
                    if not x.accept(e):
                        continue
                    data = self.text(e)
                    layers.setdefault(n + len(data), []).append(
                        (nesting(s, data), x, path + [e], progress, sig)
                    )
        return None

    # -- the literals of the schema's patterns ------------------------------------------------------
    def witnesses(self) -> list[list[int]]:
        """Per `pattern` of the schema (the first MAX_WITNESSES), a short string it matches (as one-byte
        tokens, no `"` or `\\`): written inside a string it lets the string close. Built once, in the
        input pool before the grammar's first request is admitted (InputProcessor), not on the model
        thread's budget."""
        with self._lock:
            if self._witnesses is None:
                found = []
                for p in _patterns(self.spec)[:MAX_WITNESSES]:
                    try:
                        g = self._backend.compile(OutputConstraint.regex(p))
                    except ValueError:  # a dialect the regex backend reads differently: no literal
                        continue
                    budget = Budget(WITNESS_SECONDS, PLAN_EXPANSIONS, float("inf"))
                    budget.start()
                    try:
                        path = self._search(
                            g.matcher(),
                            '"',
                            lambda d, s: d.is_accepting(),
                            _STRING,
                            [],
                            _WITNESS_BYTES,
                            budget,
                            [0, 0.0, 0.0],  # the pattern's own grammar
                        )
                    except (
                        _OverBudget
                    ):  # `[^x]{463,}` searched 3.8 s (Python: the GIL the model thread needs)
                        path = None
                    budget.end(skipped=path is None)
                    if path:
                        found.append([t for e in path for t in e])
                self._witnesses = found
            return self._witnesses

    def built_witnesses(self) -> list[list[int]]:
        """The witnesses if they are built, else none (a plan does not wait for, or build, them)."""
        return self._witnesses or []


class _Bits:
    """A search state's one-byte probes: the signature's bits and the alphabet's, read from one mask of
    its matcher (one call) or by a validate per byte, whichever was cheaper on this grammar's first
    states of the kind (`Closer._cost`, per alphabet). Usually the mask; but a mask walks the whole
    vocabulary, and in some grammars (a string of 3 to 64 `[A-z]` under SmolLM2's 49,152 tokens) it
    took ~0.35 ms a state, its plans ~9 times as long as by probes. Both read the same bits where
    nothing is forced (there llguidance's mask offers the forced text in its canonical tokens only:
    not read here)."""

    TRIALS = 4  # states read both ways before the cheaper one is kept

    def __init__(self, words: int, probe: list[int], letters: list[int], cost: list[float], budget: Budget):
        self._row = torch.zeros(words, dtype=torch.int32)
        self._words = self._row.numpy()
        self._tokens = probe + letters
        at = np.array(self._tokens, dtype=np.int64)
        self._at, self._shift, self._n = at >> 5, (at & 31).astype(np.int32), len(probe)
        self._cost, self._budget = cost, budget  # [states read both ways, mask seconds, validate seconds]

    def read(self, m) -> tuple[tuple[int, ...], tuple[int, ...]]:
        cost = self._cost
        if cost[0] < self.TRIALS:
            t0 = time.perf_counter()
            on = self._validated(m)
            t1 = time.perf_counter()
            self._masked(m)
            cost[0] += 1
            cost[1] += time.perf_counter() - t1
            cost[2] += t1 - t0
        else:
            on = self._masked(m) if cost[1] <= cost[2] else self._validated(m)
        return tuple(on[: self._n]), tuple(on[self._n :])

    def _masked(self, m) -> list[int]:
        self._budget.check()
        m.fill_bitmask(self._row)
        return ((self._words[self._at] >> self._shift) & 1).tolist()

    def _validated(self, m) -> list[int]:
        out = []
        for t in self._tokens:
            self._budget.check()  # a probe can cost milliseconds while a lexer builds a counted repetition
            out.append(m.validate([t]))
        return out


def _representatives(allowed: list[int]) -> list[int]:
    """Bytes to try: every punctuation byte, but digits / lower / upper case letters by the first and
    last allowed of each (within a run they usually lead to the same state)."""
    out, runs = [], {}
    for b in allowed:
        c = chr(b)
        kind = "d" if c.isdigit() else "l" if c.islower() else "u" if c.isupper() else None
        if kind is None:
            out.append(b)
        else:
            runs.setdefault(kind, []).append(b)
    for run in runs.values():
        out += run[:1] + run[-1:] if len(run) > 1 else run
    return out


_CLOSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CLOSERS_LOCK = threading.Lock()


def closer_for(grammar) -> Closer:
    """The Closer of a compiled grammar (one per grammar, made on first use)."""
    with _CLOSERS_LOCK:
        c = _CLOSERS.get(grammar)
        if c is None:
            c = _CLOSERS[grammar] = Closer(grammar)
        return c


def prepare(grammar, limit: int | None = None) -> Closer:
    """closer_for, with what its plans read built first (the witnesses) and the plan from the
    grammar's start within `limit` tokens (a request's max_tokens): called on the request side, before
    a request that may be closed is admitted, so that neither is made on the model thread (each
    request's first look is a plan from the start: 64 JSON requests whose shortest answer did not fit
    spent their plan budgets there, 20 ms then, one a step: +4.5 ms a step at batch 64 on the H200)."""
    c = closer_for(grammar)
    c.witnesses()
    if limit is not None:
        c.plan(grammar.matcher(), "", limit, on_step=False)
    return c
