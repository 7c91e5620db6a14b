"""One step's rows, built once from the scheduled items for both ways of running a step: the eager
forward pass (ModelRunner._prepare) and a decode-step graph (ModelRunner._graph_decode). Plain values
only (lists of ints), so a new kind of row is written here once.

    items:  [d0 | d1 | v2 v2 v2 | p0 p0 p0 p0 | p1 p1]     decodes and verify runs, then prefill chunks
    query:   1    1    1  1  1    4 (one query)  2          a decode-like item is one query per token

A row's input token may still be on the device (async scheduling's tokens in flight, drafts staged
there): `pending` names its flat index in the runner's token buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from foveal.sched.batch import DEVICE_DRAFT, ScheduledItem


@dataclass(slots=True)
class StepRows:
    ids: list[int] = field(default_factory=list)  # each row's input token (0 where `pending` has it)
    pending: list[int] = field(default_factory=list)  # per row: token-buffer index of its input, or -1
    positions: list[int] = field(default_factory=list)  # each row's index in its sequence
    rope: list[int] = field(default_factory=list)  # each row's 1-D rotary position (index + shift)
    slots: list[int] = field(default_factory=list)  # each row's KV-cache slot
    query_lens: list[int] = field(default_factory=list)  # attention queries: decodes first
    context_lens: list[int] = field(default_factory=list)
    # each query's block table: the item's own object, not a copy (a request's rows share it)
    block_tables: list[Sequence[int]] = field(default_factory=list)
    num_decodes: int = 0  # one-token queries
    logits_rows: list[int] = field(default_factory=list)  # the rows whose logits the step needs
    # every row is a one-token query of a generated token (or a block diffusion row): a decode-step
    # graph can run the step
    short_queries: bool = True
    block_diffusion: bool = False  # some rows are a block diffusion model's (keys not at their contexts)

    @property
    def num_rows(self) -> int:
        return len(self.ids)

    @property
    def any_pending(self) -> bool:
        return bool(self.pending)


def staged_drafts(s: ScheduledItem, slot: int, width: int) -> range:
    """The flat token-buffer indices of a verify item's drafts staged on the device (DEVICE_DRAFT ids
    in the item; rows 1 .. k of the request's buffer row `slot`), or an empty range when the host
    knows them."""
    if not s.num_drafts or s.token_ids[-1] != DEVICE_DRAFT:
        return range(0)
    return range(slot * width + 1, slot * width + 1 + s.num_drafts)


def build_rows(
    items: list[ScheduledItem],
    held: Mapping[str, Any],
    width: int,
    block_size: int,
    key_limits: Callable[[ScheduledItem], list[int] | None] | None = None,
) -> StepRows:
    """The rows of `items`. `held[request_id]` gives `.slot` (its token-buffer row, `width` wide),
    `.shift` (generated tokens' position past their index) and `.req` (its NewRequest);
    `key_limits(item)`: a block diffusion item's per-row last keys (diffusion/passes.py), else None."""
    out = StepRows()
    ids, pos, rope, slots = out.ids, out.positions, out.rope, out.slots
    q_lens, ctxs, tables, logits = out.query_lens, out.context_lens, out.block_tables, out.logits_rows
    pending = out.pending  # filled lazily: stays empty when no row reads the buffer
    bs = block_size
    prefill_seen = False
    other_rows = False  # rows that are not a block diffusion model's
    for s in items:
        h = held[s.request_id]
        n, base, shift = len(s.token_ids) + s.num_pending, len(ids), h.shift
        rows_ctx = key_limits(s) if key_limits is not None else None
        decode = (s.num_logits == n and s.denoise < 0) or rows_ctx is not None
        if decode and prefill_seen:
            raise ValueError(f"{s.request_id}: decode items must come before prefill chunks in a batch")
        p, bt = s.start, s.block_table
        other_rows |= rows_ctx is None
        if rows_ctx is None and not (decode and p >= len(h.req.prompt_token_ids)):
            out.short_queries = False  # a prompt chunk, or a prompt token's query
        if n == 1 and decode and rows_ctx is None:  # a plain decode (the common row: kept lean)
            if s.num_pending:
                pending += [-1] * (base - len(pending))
                pending.append(h.slot * width)
                ids.append(0)
            else:
                ids.append(s.token_ids[0])
            pos.append(p)
            rope.append(p + shift)
            slots.append(bt[p // bs] * bs + p % bs)
            out.num_decodes += 1
            q_lens.append(1)
            ctxs.append(p)
            tables.append(bt)
            logits.append(base)
            continue
        prefill_seen = prefill_seen or not decode
        ids.extend(s.token_ids)
        staged = staged_drafts(s, h.slot, width)
        if staged:  # drafts still on the device: read from the buffer
            pending += [-1] * (len(ids) - len(staged) - len(pending))
            pending.extend(staged)
        if s.num_pending:
            pending += [-1] * (len(ids) - len(pending))
            pending.extend(range(h.slot * width, h.slot * width + s.num_pending))
            ids += [0] * s.num_pending
        r = range(p, p + n)
        pos.extend(r)
        rope.extend(range(p + shift, p + n + shift))
        slots.extend(bt[q // bs] * bs + q % bs for q in r)
        if decode:  # a short query: one attention row per token, each after the ones before it
            out.num_decodes += n
            q_lens += [1] * n
            ctxs.extend(r if rows_ctx is None else rows_ctx)
            tables += [bt] * n
            out.block_diffusion |= rows_ctx is not None
        else:
            q_lens.append(n)
            ctxs.append(p)
            tables.append(bt)
        logits.extend(range(base + n - s.num_logits, base + n))
    if pending:
        pending += [-1] * (len(ids) - len(pending))
    if out.block_diffusion and other_rows:
        out.short_queries = False  # a graph takes diffusion rows' slots only when every row is one
    return out
