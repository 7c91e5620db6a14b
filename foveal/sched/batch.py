"""What the scheduler hands the runner for one step: plain data, decodes first, then prefill chunks."""

from __future__ import annotations

from dataclasses import dataclass, field

from foveal.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    request: Request
    start: int  # position of the first new token (= tokens already in the cache)
    num_tokens: int  # new tokens this step (1 for a decode)
    sample: bool  # True when this chunk reaches the end of the sequence: sample the next token

    @property
    def token_ids(self) -> list[int]:
        return self.request.all_token_ids[self.start : self.start + self.num_tokens]


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to the waiting queue

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs
