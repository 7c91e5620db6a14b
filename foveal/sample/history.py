"""What the penalties count, kept on the sampler's device per request slot: built once when a request
with penalties first samples, then updated by each step's tokens on the device, never rebuilt from the
host's token lists (and never waiting for them: such rows overlap under async scheduling).

    counts  int32 [slots, vocab]  each token's occurrences in the output so far (frequency, presence)
    prompt  bool  [slots, vocab]  the tokens of the prompt (the repetition penalty's "seen" is
                                  prompt | counts > 0)

A slot is the runner's row of its token buffer (one per held request); the buffers grow with it.
"""

from __future__ import annotations

import array

import torch

from foveal.device import to_device


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
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=self.device)

    def _fit(self, slot: int) -> None:
        n = self.counts.shape[0]
        if slot < n:
            return
        grow = max(slot + 1, 2 * n, 16) - n
        self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab)])

    def start(self, slot: int, prompt: list | tuple, output: list, with_prompt: bool) -> None:
        """The slot's rows for a request: its output so far counted, its prompt marked (with_prompt:
        only a repetition penalty reads it)."""
        self._fit(slot)
        lists = [output, prompt if with_prompt else []]
        both = occurrence_counts(lists, self.vocab, self.device)
        self.counts[slot] = both[0]
        self.prompt[slot] = both[1] > 0

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """One more occurrence of each row's token (on the device: the tokens need not be on the host)."""
        flat = slots * self.vocab + tokens  # index_add_ adds atomically: no sort, as index_put_'s has
        self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output counts int32 [n, vocab], prompt bool [n, vocab]) of the slots."""
        return self.counts.index_select(0, slots), self.prompt.index_select(0, slots)
