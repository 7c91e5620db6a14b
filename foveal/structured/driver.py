"""Structured outputs' driver in the runner: the grammar masks of a step's constrained rows, each
guide moved over its request's new tokens, and the totals the metrics read. The runner keeps each
held request's `Guide` (made here at admission) and calls, once a step:

    driver.masks(items, num_rows, guide_of)   before sampling: the masks of the rows that need one
    driver.advance(guide, rid, toks, ends)    after a step's tokens arrive: a failure, a grammar done
    driver.report()                           the metrics' totals

so the runner holds no grammar logic of its own (foveal/structured/guide.py is the per-request part).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from foveal.device import to_device
from foveal.sched.batch import DEVICE_DRAFT, ScheduledItem
from foveal.structured import closing
from foveal.structured.guide import Guide, GuideEnds, GuideSetup

log = logging.getLogger(__name__)


class GuideDriver:
    def __init__(self, device):
        self.device = torch.device(device)
        self.mask_seconds = 0.0  # host time spent filling grammar masks (and the rows filled)
        self.mask_rows = 0
        self.closed_answers = 0  # answers closed early for max_tokens (closing.py)
        self.num_guided = 0  # held requests with a guide: none, and a step fills no masks at all
        self._mask_bufs: list[torch.Tensor | None] = [None, None]
        self._mask_turn = 0

    def admit(self, setup: GuideSetup | None) -> Guide | None:
        """A new request's guide (None: unconstrained)."""
        if setup is None:
            return None
        self.num_guided += 1
        return Guide(setup)

    def release(self, guide: Guide | None) -> None:
        self.num_guided -= guide is not None

    def masks(self, items: list[ScheduledItem], num_rows: int, guide_of: Callable[[str], Guide | None]):
        """The grammar masks of the step's constrained logits rows, on the device, and their rows (None
        if there are none): a verify run's row j is masked as if its drafts 1..j were accepted. Plain
        grammar rows come first, filled in one call of the backend (in parallel, the GIL released)."""
        if not self.num_guided:
            return None
        closing.BUDGET.new_step()
        plain: list[tuple[Guide, int]] = []  # (guide, logits row): the grammar's own mask
        other: list[tuple[Guide, int, ScheduledItem]] = []  # forced tokens, verify runs
        row = 0
        for s in items:
            guide = guide_of(s.request_id) if s.num_logits else None
            if guide is not None:
                if s.num_drafts:
                    other.append((guide, row, s))
                elif guide.needs_mask():
                    if guide.grammar_row:
                        plain.append((guide, row))
                    else:
                        other.append((guide, row, s))
            row += s.num_logits
        if not plain and not other:
            return None
        t0 = time.perf_counter()
        guide = (plain or other)[0][0]
        masks = self._mask_buffer(num_rows, guide.spec.mask_words)
        idx = [r for _, r in plain]
        if plain:
            plain[0][0].spec.grammar.backend.fill_bitmasks([g.matcher for g, _ in plain], masks)
            for i, (g, _) in enumerate(plain):
                g.filled(masks[i])
        for g, r, s in other:
            if s.num_drafts:
                if s.drafts[0] == DEVICE_DRAFT:
                    raise RuntimeError(f"{s.request_id}: a grammar masks by the drafts, left on the device")
                g.fill_rows(list(s.drafts), masks[len(idx) : len(idx) + s.num_logits])
                idx += range(r, r + s.num_logits)
            else:
                g.fill(masks[len(idx)])
                idx.append(r)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_rows += len(idx)
        rows = torch.tensor(idx, dtype=torch.int32)
        return to_device(masks[: len(idx)], self.device), to_device(rows, self.device)

    def _mask_buffer(self, rows: int, words: int) -> torch.Tensor:
        """A host buffer for a step's masks (pinned for a GPU), two kept and used in turn: a step's
        masks may still be copying to the device while the next step's are filled."""
        self._mask_turn ^= 1
        buf = self._mask_bufs[self._mask_turn]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            pin = self.device.type == "cuda"
            buf = torch.empty(max(rows, 64), words, dtype=torch.int32, pin_memory=pin)
            self._mask_bufs[self._mask_turn] = buf
        return buf[:rows]

    def advance(self, guide: Guide, rid: str, toks: list[int], ends: GuideEnds, produced: list) -> None:
        """Move a request's guide over its new tokens; report a failure, or a grammar that is done."""
        for t in toks:
            if guide.error is None and not guide.accept(t):
                guide.error = guide.refusal(t)
                g = guide.spec.grammar
                log.warning(
                    "%s: %s; grammar %s; output %s",
                    rid,
                    guide.error,
                    g.spec.digest()[:16] if g is not None else None,
                    produced,
                )
        if guide.error is not None:
            ends.errors[rid] = guide.error
            if guide.grammar_error:
                ends.bad_grammars.add(rid)
        elif guide.terminated:
            ends.done.add(rid)
            if guide.cut:
                ends.cut.add(rid)
                self.closed_answers += 1

    @property
    def close_skipped(self) -> int:
        """Closing plans given up over their budget (lifetime; plans run on this thread only)."""
        return closing.BUDGET.skipped

    def report(self) -> dict | None:
        """Grammar totals for the metrics (StepReport.structured), or None before any masked row."""
        if not self.mask_rows:
            return None
        return {
            "mask_seconds": self.mask_seconds,
            "mask_rows": self.mask_rows,
            "closed": self.closed_answers,
            "close_skipped": self.close_skipped,
        }
