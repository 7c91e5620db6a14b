"""A diffusion model's side of the runner (the device side of diffusion/driver.py): the attention shape
of its items' rows and the sampling of its denoising passes. `engine/factory.py` gives the runner one
for a diffusion model (None otherwise); the runner calls, with each item's `shape` (NewRequest.diffusion:
(kind, block size, mask token id)):

    passes.key_limits(item, shape)          a block model's item as one-token queries: each row's last key
    passes.spans(item, shape)               the item's attention rows' both-ways spans
    passes.sample(items, reqs, logits, smp) each denoising item's (token, confidence) per row, [2, rows]
    passes.collect(host, rows, out)         those rows into the step's output, per request

Masked models (LLaDA): every token of prompt + canvas sees every token, one attention row per item.
Block models (SDAR): causal across blocks of `size` positions, both ways inside one; the rows are
one-token queries whose last key is their block's end (within the item), so the decode path of every
backend gives the shape (all of a step's keys are written before any row reads).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from foveal.diffusion.sampling import choose

if TYPE_CHECKING:
    from foveal.sched.batch import NewRequest, ScheduledItem

Shape = tuple[str, int, int]  # (kind "masked" / "block", block size, mask token id)


class DiffusionPasses:
    @staticmethod
    def key_limits(item: ScheduledItem, shape: Shape) -> list[int] | None:
        """Per fed token of a block model's item the last key it sees (its block's end, within the
        item); None for a masked model's item (one bidirectional attention row)."""
        if shape[0] != "block":
            return None
        size, a = shape[1], item.start
        b = a + item.num_tokens
        return [min(p - p % size + size, b) - 1 for p in range(a, b)]

    @staticmethod
    def spans(item: ScheduledItem, shape: Shape) -> list[list[tuple[int, int]]]:
        """The item's attention rows' spans that attend both ways: a masked model's item is one row in
        which every token sees every token; a block model's one-token rows need none (key_limits)."""
        if shape[0] == "masked":
            return [[(0, item.start + item.num_tokens)]]
        return [[] for _ in range(item.num_tokens)]

    @staticmethod
    def sample(
        items: list[ScheduledItem], reqs: list[NewRequest], logits: torch.Tensor, sampler
    ) -> tuple[list[tuple[str, int, int]], torch.Tensor | None]:
        """Each denoising item's rows (request id, first row, rows) and their (token, confidence) as one
        float64 tensor [2, rows] on the device (token ids are exact in float64), or None: no rows.
        `reqs`: each item's request; `sampler`: the runner's (its vocabulary, its top-k / top-p)."""
        rows, x0s, confs, row = [], [], [], 0
        vocab = sampler.vocab_size
        for s, req in zip(items, reqs):
            if not s.num_logits:
                continue
            if s.denoise < 0:
                raise RuntimeError(f"{s.request_id}: a diffusion model samples only in denoising passes")
            n = s.num_logits
            kind, _, mask_id = req.diffusion
            total = s.num_tokens - len(req.prompt_token_ids) if kind == "masked" else n
            x0, conf = choose(logits[row : row + n, :vocab], mask_id, req.params, s.denoise, total, sampler)
            rows.append((s.request_id, row, n))
            x0s.append(x0)
            confs.append(conf)
            row += n
        if not x0s:
            return rows, None
        return rows, torch.stack([torch.cat(x0s).double(), torch.cat(confs).double()])

    @staticmethod
    def collect(host: torch.Tensor, rows: list[tuple[str, int, int]], out) -> None:
        """A pass's rows, on the host, into RunnerOutput: per request its tokens and confidences."""
        x0, conf = host.tolist()
        for rid, first, n in rows:
            out.tokens[rid] = [int(t) for t in x0[first : first + n]]
            out.confidence[rid] = conf[first : first + n]
