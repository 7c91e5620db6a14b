"""CUDA graphs for a chain head's steps (EAGLE-3, MTP): every row a one-token query, as the target's
decode-step graphs (worker/cuda_graphs.py: buckets, static inputs, the backend's graph metadata), with
the head's extra input and outputs in static buffers too:

    in:   token ids [max]  positions [max]  hidden states [max, H]  (+ block tables, lengths)
    out:  greedy drafts [max] (the target's ids)  the next hidden states [max, H]

A head step is ~20 small kernels on one layer: launched one by one, the host's launches cost more than
the device's work (at batch 1 a propose() of 4 eager forwards took 6.4 ms on the H200 against a 3.3 ms
target step). The catch-up chunk runs here too when every row of it fits (a row per fed position,
each seeing the keys up to its own); a long one (a new prompt) runs eagerly as a prefill chunk.
On a CPU device nothing is captured: `step` runs the same static-buffer forward eagerly (tests).
"""

from __future__ import annotations

import torch

from foveal.models.base import StepContext
from foveal.worker.cuda_graphs import DecodeGraphs


class HeadStepGraphs(DecodeGraphs):
    shared_prefixes = False  # its graphs attend plainly (a head step has one row a request)

    def __init__(
        self, head, kv_caches, backend, *, block_size: int, max_seqs: int, max_model_len: int, device
    ):
        super().__init__(
            head, kv_caches, backend, block_size=block_size, max_seqs=max_seqs, max_model_len=max_model_len,
            device=device,
        )  # fmt: skip
        dtype = next(head.parameters()).dtype
        self.hidden_in = torch.zeros(max_seqs, head.hidden_size, dtype=dtype, device=self.device)
        self.hidden_out = torch.zeros_like(self.hidden_in)
        self.draft_out = torch.zeros(max_seqs, dtype=torch.long, device=self.device)

    def _forward(self, b: int, meta) -> None:
        ctx = StepContext(self.positions[:b], self.kv_caches, meta)
        normed, hidden = self.model(self.input_ids[:b], self.hidden_in[:b], ctx)
        self.draft_out[:b].copy_(self.model.draft(normed))
        self.hidden_out[:b].copy_(hidden)

    def step(self, input_ids, hidden, positions, batch, shift=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(drafts [n], next hidden [n, H]) of n one-token rows; both are copies (the next replay
        overwrites the static outputs). `shift` [n] (on the device): each row sits that many positions
        past its position and context in `positions` / `batch` (a chain that follows a verify step)."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions if shift is None else positions + shift, non_blocking=True)
        self.hidden_in[:n].copy_(hidden)
        self.replay(batch, n, moved=None if shift is None else (shift, None))
        return self.draft_out[:n].clone(), self.hidden_out[:n].clone()
