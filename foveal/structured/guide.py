"""Steering one request's tokens: its answer's grammar, the think block before the answer, and the
thinking budget, as one state machine the structured-output driver asks for a mask at every logits row.

    GuideSetup (plain data, made on the request side)  ->  Guide (structured/driver.py's, per request)

    phase OPEN    the output may open a think block (its start marker's one token) or begin the answer:
                  the grammar's mask plus that token (no grammar: no mask)
    phase THINK   free text, no grammar, until the end marker; once `thinking_budget` thinking tokens
                  are spent, the end marker's tokens are forced one at a time
    phase ANSWER  the grammar's mask (no grammar: no mask); `terminated` once it is complete

A prompt that opened the think block (the template's generation prompt ends with it) starts in
THINK; a request without reasoning starts in ANSWER. So a grammar never sees the thinking, and a JSON
schema applies from the first answer token on, whichever side opened the block.

Closing before the budget ends (`close_budget`, the request's max_tokens): from the first step on, at
steps that halve the room left beyond the shortest way to finish, the guide asks closing.Closer for
that way (in THINK: the end marker, then the answer's). Once the tokens left are within `CLOSE_SLACK`
of it, those tokens are forced one at a time; when they are spent the guide is `cut`: the answer is
complete, the request ends with finish_reason "length". No plan found, or none that fits: the request
runs on as it would have.

Speculative rows: `fill_rows(drafts)` gives the mask of each position of a verify run by walking
the drafts tentatively and coming back (`_mark`/`_back`); a draft the state machine refuses ends the
walk (the rows after it are never used: verification stops there). Not thread-safe: one per request,
driven by the model thread.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from foveal.structured.closing import DEFER, closer_for, nesting

log = logging.getLogger(__name__)

OPEN, THINK, ANSWER = "open", "think", "answer"
CLOSE_SLACK = 4  # spare tokens when the plan starts: one token may lengthen it (a comma, then a key)


@dataclass(frozen=True, slots=True)
class GuideSetup:
    """What steers one request (EngineRequest.guide): the compiled grammar of its answer, if any, and
    its think markers as token ids."""

    grammar: Any = None  # a CompiledGrammar (foveal/structured/backend.py), shared and immutable
    think_start: tuple[int, ...] = ()
    think_end: tuple[int, ...] = ()  # () : the model has no think block
    in_thinking: bool = False  # the prompt opened the block: the output starts inside it
    may_think: bool = False  # the output may open the block itself (its first token the start marker)
    thinking_budget: int | None = None  # thinking tokens before the end marker is forced
    mask_words: int = 0  # int32 words of a mask row: ceil(V / 32), V the grammar backend's vocabulary
    close_budget: int | None = None  # max_tokens: the answer is closed before it (None: cut as it falls)


@dataclass(slots=True)
class GuideEnds:
    """The requests whose guide ended in a step (GuideDriver.advance's answer)."""

    done: set[str] = field(default_factory=set)  # the grammar is complete: nothing but EOS could follow
    cut: set[str] = field(default_factory=set)  # of which closed early for max_tokens (closing.py)
    errors: dict[str, str] = field(default_factory=dict)  # the guide failed: why
    bad_grammars: set[str] = field(default_factory=set)  # of which the grammar's fault (a limit it hit)


class Guide:
    def __init__(self, spec: GuideSetup):
        self.spec = spec
        self.matcher = spec.grammar.matcher() if spec.grammar is not None else None
        if spec.in_thinking and spec.think_end:
            self.phase = THINK
        elif spec.may_think and len(spec.think_start) == 1 and spec.think_end:
            self.phase = OPEN
        else:
            self.phase = ANSWER
        self.thinking_tokens = 0
        self._end = 0  # tokens of the end marker matched (or forced) so far
        self.error: str | None = None
        self.grammar_error = False  # the error is the grammar's (a limit it hit), not a fault of ours
        self.num_tokens = 0  # tokens produced (thinking included): what the budget counts
        self.cut = False  # the closing plan was spent: the answer ended for the budget
        self._closer = None
        if spec.close_budget is not None and self.matcher is not None:
            self._closer = closer_for(spec.grammar)
        self._nest = ""  # the answer's JSON nesting (closing.nesting) before its tokens _unread
        self._unread: list[int] = []  # answer tokens since the last look, while closing may come
        self._plan: tuple[int, ...] = ()  # the closing tokens being forced
        self._planned = 0  # of which produced
        # look for a plan once the tokens left are this few (None: never)
        self._look_at = spec.close_budget if self._closer is not None else None
        self._walking = False  # fill_rows is walking drafts: no planning then

    # -- state --------------------------------------------------------------------------------------
    @property
    def terminated(self) -> bool:
        """The answer is complete: its grammar allows nothing but EOS, or the closing plan was spent."""
        if self.cut:
            return True
        return self.phase == ANSWER and self.matcher is not None and self.matcher.is_terminated()

    def _forcing(self) -> bool:
        b = self.spec.thinking_budget
        return self.phase == THINK and ((b is not None and self.thinking_tokens >= b) or self._end > 0)

    def _closing(self) -> bool:
        return self._planned < len(self._plan)

    def needs_mask(self) -> bool:
        """Whether the next position is constrained (else the row samples freely)."""
        if not self._walking:
            self._look()
        if self._closing():
            return True
        if self.phase == THINK:
            return self._forcing()
        return self.matcher is not None

    def fill(self, row: torch.Tensor) -> None:
        """The next position's allowed tokens into `row` (int32 words; needs_mask() was True)."""
        if self._closing():  # exactly the plan's next token
            row.zero_()
            _set(row, self._plan[self._planned])
            return
        if self.phase == THINK:  # forcing the end marker: exactly its next token
            row.zero_()
            _set(row, self.spec.think_end[self._end])
            return
        self.matcher.fill_bitmask(row)
        self.filled(row)

    @property
    def grammar_row(self) -> bool:
        """The next mask is the grammar matcher's (filled with other rows' in one parallel call of the
        backend, then `filled(row)`), not a forced token."""
        return self.phase != THINK and self.matcher is not None and not self._closing()

    # -- closing before the budget ends ---------------------------------------------------------------
    def _look(self) -> None:
        """At the steps the schedule picks, plan the shortest end; force it once it barely fits."""
        if self._look_at is None or self._plan or self.cut or self.error is not None:
            return
        left = self.spec.close_budget - self.num_tokens
        if left > self._look_at:
            return
        head: tuple[int, ...] = ()
        if self.phase == THINK:  # end the thought first: the rest of its end marker
            head = self.spec.think_end[self._end :]
        if self._unread:  # the nesting of the answer's tokens since the last look
            self._nest = nesting(self._nest, self._closer.text(self._unread))
            self._unread.clear()
        plan = self._closer.plan(self.matcher, self._nest if self.phase == ANSWER else "", left - len(head))
        if plan is DEFER:  # the step's planning budget is spent: look again at the next step
            return
        if plan is None:  # no way found, or none that fits: the request runs on as it would have
            self._look_at = None
            return
        need = len(head) + len(plan)
        room = left - need
        if room > CLOSE_SLACK:
            self._look_at = left - max(1, (room - CLOSE_SLACK) // 2)
            return
        if not head and not plan:  # complete already: end it here (before a token could undo that)
            plan = [min(self.spec.grammar.backend.eos_token_ids)]
        self._plan, self._planned, self._look_at = head + tuple(plan), 0, None
        log.debug("closing with %d tokens left: %d forced", left, len(self._plan))

    def filled(self, row: torch.Tensor) -> None:
        """After the matcher filled `row`: note its error; in OPEN, allow the think-start token too."""
        if self.matcher.error is not None:
            self._grammar_failed()
        if self.phase == OPEN:
            _set(row, self.spec.think_start[0])

    def accept(self, token: int) -> bool:
        """Advance over one produced token; False (state unchanged) when the guide forbids it."""
        closing = self._closing()
        if closing and token != self._plan[self._planned]:
            return False
        if not self._step(token):
            return False
        self.num_tokens += 1
        if closing:
            self._planned += 1
            self.cut = self._planned == len(self._plan)
        return True

    def _step(self, token: int) -> bool:
        spec = self.spec
        if self.phase == OPEN:
            if token == spec.think_start[0]:
                self.phase = THINK
                return True
            self.phase = ANSWER
            if not self._answer(token):
                self.phase = OPEN
                return False
            return True
        if self.phase == THINK:
            end = spec.think_end
            if self._forcing() and token != end[self._end]:
                return False
            if token == end[self._end]:
                self._end += 1
                if self._end == len(end):
                    self.phase, self._end = ANSWER, 0
            else:
                self._end = 0
                self.thinking_tokens += 1
            return True
        return self._answer(token)

    def _answer(self, token: int) -> bool:
        if self.matcher is None:
            return True
        if self.matcher.accept([token]):
            if self._look_at is not None:
                self._unread.append(token)
            return True
        if self.matcher.error is not None:
            self._grammar_failed()
        return False

    def _grammar_failed(self) -> None:
        """The matcher hit a limit of its grammar (a parser row, the lexer's expressions): the request's
        fault, not the server's (`grammar_error`); the grammar notes it, and is refused from then on."""
        self.error = f"the grammar exceeded a limit of the parser: {self.matcher.error}"
        self.grammar_error = True

    def refusal(self, token: int) -> str:
        """Why `token` was refused, for the request's error: whether the current mask allows it tells a
        sampling fault (it did not) from a matcher that contradicts its own mask (it did)."""
        if self.error is not None:
            return self.error
        if not self.needs_mask():
            return f"the guide refused token {token} in phase {self.phase}"
        row = torch.zeros(self.spec.mask_words, dtype=torch.int32)
        self.fill(row)
        word, bit = divmod(token, 32)
        allowed = word < row.numel() and (int(row[word]) >> bit) & 1
        if allowed and self.phase != THINK and self.matcher is not None:
            stuck = self.matcher.unwritable()
            if stuck is not None:  # the grammar's fault, not the sampler's: llguidance offers a wrong byte
                self.grammar_error = True
                return stuck
        verdict = "allows" if allowed else "forbids"
        return f"the grammar does not allow token {token} here (its mask {verdict} it)"

    # -- speculative runs -----------------------------------------------------------------------------
    def _mark(self) -> tuple:
        n = self.matcher.num_tokens if self.matcher else 0
        closing = self.num_tokens, len(self._unread), self._planned, self.cut  # no look while walking
        return self.phase, self.thinking_tokens, self._end, n, closing

    def _back(self, mark: tuple) -> None:
        self.phase, self.thinking_tokens, self._end, n, closing = mark
        self.num_tokens, unread, self._planned, self.cut = closing
        del self._unread[unread:]
        if self.matcher is not None and self.matcher.num_tokens > n:
            self.matcher.rollback(self.matcher.num_tokens - n)

    def fill_rows(self, drafts: list[int], rows: torch.Tensor) -> None:
        """rows[j] = the mask after drafts[:j] (j = 0 .. len(drafts)); the state is left unchanged. A
        row after a draft the guide refuses copies the row before it (verification stops earlier)."""
        self._look()
        mark = self._mark()
        self._walking = True
        try:
            for j in range(len(drafts) + 1):
                if self.needs_mask():
                    self.fill(rows[j])
                else:
                    rows[j].fill_(-1)
                if j == len(drafts) or not self.accept(drafts[j]):
                    rows[j + 1 :] = rows[j]
                    break
        finally:
            self._walking = False
            self._back(mark)


def _set(row: torch.Tensor, token: int) -> None:
    word, bit = divmod(token, 32)
    v = int(row[word]) | (1 << bit)
    row[word] = v - (1 << 32) if v >= 1 << 31 else v  # int32 two's complement
