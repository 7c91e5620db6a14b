"""The proposer protocol, and the n-gram proposer.

Before each step the speculation driver (driver.py) asks the proposer for drafts for the rows that may
speculate (running decodes with every token known): each `ProposeRow` names the request, all its tokens
so far (prompt + output, read-only) and how many drafts it may take. After the step's verification the
proposer hears how many were accepted, and when a request ends it is told to forget it. A proposer owns
whatever it keeps per request (an n-gram index, a draft model's KV); the engine keeps nothing of it.

    step, through the driver:  propose(rows) -> drafts per row -> schedule 1 + k tokens -> verify
                               -> accepted(...)

A drafter that computes its drafts on the device (the hidden-state heads) also offers
`propose_device(rows)`: the drafts of every row in one flat device tensor, row after row, and each
row's count. The driver then stages them in the runner's token buffer without reading them back, so
the host schedules and launches the verify step while the device still drafts (only rows whose
sampling reads the drafts' values, a grammar or penalties, have them read back).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from foveal.speculative.ngram import NgramIndex


@dataclass(frozen=True, slots=True)
class ProposeRow:
    request_id: str
    token_ids: Sequence[int]  # prompt + output so far (read-only; the engine's list)
    max_drafts: int  # the most drafts this row may take now (k, fewer near a length limit)


@dataclass(frozen=True, slots=True)
class VerifyRun:
    """One request's verify rows in a launched step, where a drafter that follows the step on the
    device (`follow`) finds them: rows `start` .. `start + num_drafts` of the request, the first at
    row `tapped_row` of the step's tapped states and `token_row` of its tokens, its accepted count at
    `item` of the step's accepted counts."""

    request_id: str
    start: int  # the position of its first row (the token before the drafts)
    num_drafts: int
    tapped_row: int
    token_row: int
    item: int


class Proposer(Protocol):
    num_speculative_tokens: int
    # a drafter that reads the target's hidden states (spec/hidden.py) names what the target's runner
    # keeps per token (`tap_layers`, `fuse`) and hears it through observe_hidden; None for the others
    tap: object | None

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]: ...

    # optional: def propose_device(self, rows) -> tuple[torch.Tensor, list[int]]  (see the module doc)
    # optional: def follow(self, runs: list[VerifyRun], tokens, accepted, tapped) -> None: the next
    # proposal computed on the device behind a launched verify step (spec/hidden.py's ChainProposer)

    def observe_hidden(self, states: dict) -> None: ...  # called only when `tap` is set

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None: ...

    def finish(self, request_id: str) -> None: ...


def split_drafts(values: Sequence[int], counts: Sequence[int]) -> list[list[int]]:
    """Flat drafts, row after row, back into one list per row (`counts` drafts each)."""
    out, at = [], 0
    for c in counts:
        out.append(list(values[at : at + c]))
        at += c
    return out


class NgramProposer:
    """vLLM's `ngram` method: the continuation of the most recent earlier occurrence of the row's last
    n tokens (n from prompt_lookup_max down to prompt_lookup_min), in its own prompt and output."""

    tap = None

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int):
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, NgramIndex] = {}

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        out = []
        for row in rows:
            idx = self._index.get(row.request_id)
            if idx is None:
                idx = self._index[row.request_id] = NgramIndex(self.min_n, self.max_n)
            idx.extend(row.token_ids[len(idx) :])
            out.append(idx.propose(min(row.max_drafts, self.num_speculative_tokens)))
        return out

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass  # the accepted tokens arrive with the row's token_ids next time

    def finish(self, request_id: str) -> None:
        self._index.pop(request_id, None)


def build_proposer(config, *, target=None, target_source=None, **engine_parts) -> Proposer:
    """The proposer a SpeculativeConfig names; a draft model takes the target's device, dtype,
    attention backend, max_model_len and KV geometry (num_blocks, block_size) as keywords, and a head
    that reads hidden states (eagle3, mtp, dflash) the target model and its checkpoint too."""
    if config.method == "draft_model":
        from foveal.speculative.draft_model import build_draft_proposer

        return build_draft_proposer(config, **engine_parts)
    if config.method in ("eagle3", "mtp", "dflash"):
        from foveal.speculative.hidden import build_hidden_proposer

        return build_hidden_proposer(config, target=target, target_source=target_source, **engine_parts)
    if config.method == "ngram":
        return NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
    raise ValueError(f"speculative method {config.method!r} has no proposer here")
