"""What the scheduler hands the runner for one step: plain, frozen data that names requests by id.

The runner never sees a live `Request`: it learns a request once (`NewRequest`, the first step that
schedules it), keeps what it needs for itself, and forgets it when the request id comes back in
`ModelRunner.release` (after the step in which it finished). So a batch could be broadcast as-is
to other ranks, and a release list beside it.

One item feeds a run of consecutive positions of one request and says which of them give logits:

    prefill chunk       start=0   tokens [t0 .. t9]         num_logits 0 (more to come) or 1 (the last)
    decode              start=p   tokens [x]                num_logits 1
    decode, async       start=p   tokens []  num_pending 1  x is still on the device (the runner's buffer)
    verify (k drafts)   start=p   tokens [x d1 .. dk]       num_logits 1+k, num_drafts k
    verify, staged      start=p   tokens [x -1 .. -1]       the drafts are on the device (DEVICE_DRAFT)
    denoise (diffusion) start=w   tokens [window]           num_logits: the window's rows, denoise >= 0

Fed positions are start .. start + num_tokens - 1: the host-known `token_ids`, then `num_pending`
tokens the previous step sampled and the host has not seen yet. A decode item is a short query whose
every position gives logits; items come decodes first, then prefill chunks (the attention layout).
Drafts' K/V is provisional: verification keeps the accepted ones and the scheduler rewinds the rest.
A drafter that drafts on the device leaves its drafts there: the engine stages them in the runner's
token buffer (`ModelRunner.stage_drafts`: row j + 1 of the request's slot holds draft j) and the item
carries DEVICE_DRAFT in their place; the host learns them with the step's tokens (an accepted draft
is the token verification emits at its row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from foveal.request import MultiModalItem, SamplingParams

if TYPE_CHECKING:
    from foveal.lora.driver import LoRAStep

DEVICE_DRAFT = -1  # a draft id only the device knows (staged in the runner's token buffer)


class ScheduledItem(NamedTuple):
    """Immutable; a tuple, not a frozen dataclass: one is built per row per step, and a frozen
    dataclass costs twice as much to build (256 rows: ~0.2 ms a step)."""

    request_id: str
    start: int  # position of the first fed token (= tokens of the request already in the cache)
    token_ids: tuple[int, ...]  # fed tokens the host knows, drafts last
    block_table: tuple[int, ...]  # the request's blocks, covering every fed position
    num_logits: int = 0  # the last num_logits fed positions give logits (0: a prefill chunk mid-prompt)
    num_pending: int = 0  # fed tokens after token_ids that are still on the device
    num_drafts: int = 0  # the last num_drafts of token_ids are proposals, verified by this step
    # a diffusion model's denoising pass (the request's pass index, >= 0): the item is one chunk whose
    # rows see each other both ways, its K/V is provisional, each logits row gives (token, confidence)
    denoise: int = -1

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    @property
    def is_decode(self) -> bool:
        """A short query: every fed position gives logits (a decode, or a verify run of 1 + k)."""
        return self.num_logits == self.num_tokens and self.denoise < 0

    @property
    def committed(self) -> bool:
        """Whether every K/V this item writes is kept (no drafts to verify, not a denoising pass)."""
        return self.num_drafts == 0 and self.denoise < 0

    @property
    def drafts(self) -> tuple[int, ...]:
        return self.token_ids[len(self.token_ids) - self.num_drafts :] if self.num_drafts else ()


@dataclass(frozen=True, slots=True)
class NewRequest:
    """Everything the runner keeps about a request, sent with the first step that schedules it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    mm_items: tuple[MultiModalItem, ...] = ()
    rope: Any = None  # the model family's positions for the prompt (MultiModalPrompt.rope), for the model
    # a diffusion model's request: (kind, block, mask token id); its attention: ("masked", 0, m) every
    # token sees every token, ("block", size, m) causal across blocks of `size` positions, both ways
    # inside one; None: an autoregressive request
    diffusion: tuple[str, int, int] | None = None
    pooling: str | None = None  # an embedding request: its prompt's hidden states pooled ("last", "mean")


@dataclass(slots=True)
class ScheduledBatch:
    items: list[ScheduledItem] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids sent back to the waiting queue
    lora: LoRAStep | None = None  # per item its adapter's slot and the slot writes first (lora/driver.py)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.items)

    @property
    def empty(self) -> bool:
        return not self.items
