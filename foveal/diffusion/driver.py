"""Diffusion decoding's driver on the scheduling side: what a diffusion request's step is, and what its
pass's tokens do. `engine/factory.py` builds one for a diffusion model; the engine and the scheduler
hold None otherwise and branch on that alone.

    driver.admit(req)                      the request's canvas (state.py), when it is added
    driver.plan(req, budget, start)        its next item: a denoising pass, a commit, a prompt chunk
    driver.item(req, plan)                 that item, and whether it goes with the decode rows
    driver.usable_prefix(req, cached)      the part of a prefix-cache hit it may use
    driver.written(req, item)              an item without logits ran (the final window's K/V)
    driver.denoised(req, item, x0, conf)   a pass's rows reached the host: the tokens that turned final

The scheduler keeps what every request shares: the token budget, allocation, preemption, stops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from foveal.diffusion.state import new_diffusion_state
from foveal.sched.batch import ScheduledItem

if TYPE_CHECKING:
    from foveal.diffusion.info import DiffusionInfo
    from foveal.request import Request

# (start, tokens, logits rows, denoise pass or -1): one planned item
Plan = tuple[int, tuple[int, ...], int, int]


class DiffusionDriver:
    """Plans and applies a diffusion model's passes (masked: LLaDA; block: SDAR)."""

    def __init__(self, info: DiffusionInfo, recompute_prefix: bool = False):
        self.info = info
        # a block model's yardstick (benchmarks/diffusion.py): requests admitted while set keep no K/V
        # and compute their prefix again in every pass
        self.recompute_prefix = recompute_prefix

    def admit(self, req: Request) -> None:
        """A new request: its canvas and denoising schedule."""
        req.diffusion = new_diffusion_state(self.info, req)
        if self.recompute_prefix:
            req.diffusion.recompute_prefix = True

    @staticmethod
    def plan(req: Request, budget: int, start: int) -> Plan | None:
        """The request's next item from `start` (its computed positions) within `budget`, or None when
        it does not fit this step. Masked models compute prompt + canvas each pass; block models first
        the prompt's (or, after a preemption, the committed) whole blocks, then their window: a
        denoising pass, or the final window's commit together with the next window's first pass (both
        in one forward: the next window's rows see the committed keys written in the same step)."""
        d = req.diffusion
        if d.kind == "masked":
            toks = tuple(req.prompt_token_ids) + tuple(d.canvas)
            if len(toks) > budget:
                return None
            return 0, toks, d.canvas_len - d.active[0], d.step_index
        if d.recompute_prefix:  # no K/V kept: every pass computes the prefix again (a yardstick)
            end = d.window_start + (len(d.canvas) if d.commit_pending else 0)
            window = (d.mask_id,) * d.block if d.commit_pending else tuple(d.canvas)
            toks = tuple(req.all_token_ids[:end]) + window
            return (0, toks, len(window), d.step_index) if len(toks) <= budget else None
        if start < d.window_start:
            n = min(d.window_start - start, budget)
            n -= n % d.block  # whole blocks (a chunk holds every key its rows see both ways)
            if n == 0:
                return None
            return start, tuple(req.all_token_ids[start : start + n]), 0, -1
        if len(d.canvas) > budget:
            return None
        if d.commit_pending:  # the final window's K/V, and (when it fits) the next window's first pass
            if 2 * d.block > budget:
                return start, tuple(d.canvas), 0, -1
            return start, tuple(d.canvas) + (d.mask_id,) * d.block, d.block, d.step_index
        return start, tuple(d.canvas), len(d.canvas), d.step_index

    @staticmethod
    def item(req: Request, plan: Plan) -> tuple[ScheduledItem, bool]:
        """The planned item, and whether it goes with the decodes: a block model's rows are one-token
        queries (DiffusionPasses.key_limits), a masked model's item is a chunk."""
        start, toks, num_logits, denoise = plan
        item = ScheduledItem(req.request_id, start, toks, req.block_table, num_logits, denoise=denoise)
        return item, req.diffusion.kind == "block"

    @staticmethod
    def usable_prefix(req: Request, cached: list[int], block_size: int) -> list[int]:
        """A block model's prefix hit, cut to whole attention blocks of committed tokens (a token's K/V
        depends on the rest of its block); masked models keep nothing."""
        d = req.diffusion
        if d.kind == "masked" or d.recompute_prefix:
            return []
        cached = list(cached)
        while cached and (len(cached) * block_size > d.window_start or len(cached) * block_size % d.block):
            cached.pop()
        return cached

    @staticmethod
    def written(req: Request, s: ScheduledItem) -> None:
        """An item without logits ran: where it was the final window's commit, its K/V is written."""
        d = req.diffusion
        if d.commit_pending and s.start == d.window_start and s.num_tokens:
            d.committed()

    @staticmethod
    def denoised(req: Request, x0: list[int], confidence) -> tuple[list[int], int]:
        """A denoising pass's rows reached the host: the canvas takes the chosen tokens. Returns the
        tokens that turned final (the request's new output, in order) and the position its K/V is kept
        up to (the window's is provisional)."""
        d = req.diffusion
        if d.commit_pending:  # the pass began with the final window: its K/V stays
            d.committed()
        keep = 0 if d.recompute_prefix else d.window_start
        return d.observe(x0, confidence), keep
