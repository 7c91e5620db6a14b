"""Structured outputs' driver, on the scheduling side: each steered request's `Guide` (grammar
matcher, think block, closing plan), the grammar masks of a step's constrained rows, each guide moved
over its request's new tokens, and the totals the metrics read. The engine calls:

    driver.admit(rid, setup)       a request arrives (no setup: unconstrained, nothing kept)
    driver.masks(items)            before a step is sampled: its masks, as plain device tensors
    driver.advance(tokens)         a step's tokens arrived: the guides that failed or completed
    driver.release(rids)           requests that finished (the one teardown path)
    driver.report()                the metrics' totals

The runner receives the masks and their rows only (Sampler.sample's `masks`): no matcher, no grammar
crosses to the device side (foveal/structured/guide.py is the per-request part).
"""

from __future__ import annotations

import logging
import time

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
        self.guides: dict[str, Guide] = {}  # request id -> its guide (steered requests only)
        self._mask_bufs: list[torch.Tensor | None] = [None, None]
        self._mask_turn = 0

    def admit(self, request_id: str, setup: GuideSetup | None) -> None:
        """A new request: its guide, if it is steered."""
        if setup is not None:
            self.guides[request_id] = Guide(setup)

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests (idempotent)."""
        for rid in request_ids:
            self.guides.pop(rid, None)

    @property
    def num_guided(self) -> int:
        return len(self.guides)

    def steers(self, request_id: str) -> bool:
        return request_id in self.guides

    def masks(self, items: list[ScheduledItem]):
        """The grammar masks of the step's constrained logits rows, on the device, and their rows (None
        if there are none): a verify run's row j is masked as if its drafts 1..j were accepted. Plain
        grammar rows come first, filled in one call of the backend (in parallel, the GIL released).
        Called once the guides have seen every earlier token of the step's requests."""
        if not self.guides:
            return None
        closing.BUDGET.new_step()
        plain: list[tuple[Guide, int]] = []  # (guide, logits row): the grammar's own mask
        other: list[tuple[Guide, int, ScheduledItem]] = []  # forced tokens, verify runs
        row = 0
        for s in items:
            guide = self.guides.get(s.request_id) if s.num_logits else None
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
        masks = self._mask_buffer(sum(s.num_logits for s in items), guide.spec.mask_words)
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

    def advance(self, tokens: dict[str, list[int]]) -> GuideEnds:
        """Move each steered request's guide over its new tokens (request id -> tokens, in order);
        the requests whose guide failed or is done."""
        ends = GuideEnds()
        for rid, toks in tokens.items():
            guide = self.guides.get(rid)
            if guide is not None:
                self._advance(guide, rid, toks, ends)
        return ends

    def _advance(self, guide: Guide, rid: str, toks: list[int], ends: GuideEnds) -> None:
        for t in toks:
            if guide.error is None and not guide.accept(t):
                guide.error = guide.refusal(t)
                g = guide.spec.grammar
                log.warning(
                    "%s: %s; grammar %s; after %d tokens",
                    rid,
                    guide.error,
                    g.spec.digest()[:16] if g is not None else None,
                    guide.num_tokens,
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
