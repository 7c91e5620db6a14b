"""What the penalties count, kept on the sampler's device per request slot: built once when a request
with penalties first samples, then updated by each step's tokens on the device, never rebuilt from the
host's token lists (and never waiting for them: such rows overlap under async scheduling).

    counts  int32 [slots, vocab]      each token's occurrences in the output so far (frequency, presence)
    seen    int32 [slots, vocab / 32] a bit a token (structured/bitmask.py's layout), set when the
                                      token is in the prompt (marked only for a repetition penalty)
                                      or counted: the repetition penalty's "seen", and where counts
                                      can be nonzero (a kernel reads a row's counts only at its seen
                                      tokens: a bit a column, not 4 bytes)

A slot is the runner's row of its token buffer (one per held request); the buffers grow with it.
"""

from __future__ import annotations

import array

import torch

from foveal.device import to_device
from foveal.structured.bitmask import bitmask_words, pack_bitmask, unpack_bitmask


def occurrence_counts(token_lists: list, vocab: int, dev: torch.device) -> torch.Tensor:
    """int32 [n, vocab] occurrence counts of each list, one scatter for all rows; ids outside the
    vocabulary (e.g. image placeholders) are not counted."""
    n = len(token_lists)
    counts = torch.zeros(n, vocab + 1, dtype=torch.int32, device=dev)
    total = sum(len(t) for t in token_lists)
    if total:
        buf = array.array("q")  # ~4x faster than torch.tensor(list) on long prompts
        for t in token_lists:
            buf.fromlist(t) if isinstance(t, list) else buf.extend(t)
        flat = to_device(torch.frombuffer(buf, dtype=torch.long), dev)
        lens = to_device(torch.tensor([len(t) for t in token_lists], dtype=torch.long), dev)
        row = torch.repeat_interleave(torch.arange(n, device=dev), lens, output_size=total)
        # ids outside the vocab land in the spare last column
        key = row * (vocab + 1) + flat.clamp(0, vocab)
        counts.view(-1).index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return counts[:, :vocab]


class TokenHistory:
    def __init__(self, vocab: int, device):
        self.vocab, self.device = vocab, torch.device(device)
        self.words = bitmask_words(vocab)
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(0, self.words, dtype=torch.int32, device=self.device)

    def _fit(self, slot: int) -> None:
        n = self.counts.shape[0]
        if slot < n:
            return
        grow = max(slot + 1, 2 * n, 16) - n
        self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.words)])

    def start(self, slot: int, prompt: list | tuple, output: list, with_prompt: bool) -> None:
        """The slot's rows for a request: its output so far counted, its prompt marked seen (with_prompt:
        only a repetition penalty reads it)."""
        self._fit(slot)
        lists = [output, prompt if with_prompt else []]
        both = occurrence_counts(lists, self.vocab, self.device)
        self.counts[slot] = both[0]
        self.seen[slot] = pack_bitmask(((both[0] > 0) | (both[1] > 0))[None])[0]

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """One more occurrence of each row's token, its seen bit set (on the device: the tokens need not
        be on the host). One row a slot: two rows' bits in one word would race."""
        flat = slots * self.vocab + tokens  # index_add_ adds atomically: no sort, as index_put_'s has
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        at = slots * self.words + (tokens >> 5)
        words = self.seen.view(-1)
        bit = torch.bitwise_left_shift(torch.ones_like(tokens), tokens & 31)  # int64: 2**31 fits
        words[at] = words[at] | torch.where(bit >= 2**31, bit - 2**32, bit).to(torch.int32)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts int32 [n, vocab], seen bool [n, vocab]) of the slots."""
        seen = unpack_bitmask(self.seen.index_select(0, slots), self.vocab)
        return self.counts.index_select(0, slots), seen
