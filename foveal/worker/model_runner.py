"""Runs one scheduled step: builds the flat input tensors, plans attention once, runs the model,
computes logits only for rows that sample, and samples with each row's own parameters.

    tokens: [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]     decodes first, then prefill chunks
    sample:  x  x  x              x          x   (last token of a chunk that reaches the end)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foveal.attention.base import AttentionBatch
from foveal.request import TokenLogprobs
from foveal.sample.sampler import Sampler, SamplingRow
from foveal.sched.batch import ScheduledBatch


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self, model, kv_caches: list[torch.Tensor], backend, block_size: int, device, vocab_size: int
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.backend = backend
        self.block_size = block_size
        self.device = torch.device(device)
        self.sampler = Sampler(vocab_size)

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_idx: list[int] = []
        num_decodes = 0
        for s in batch.seqs:
            req = s.request
            bt = req.block_ids
            if s.num_tokens == 1:
                num_decodes += 1
                p = s.start
                ids.append(req.all_token_ids[p])
                pos.append(p)
                slots.append(bt[p // bs] * bs + p % bs)
            else:
                r = range(s.start, s.start + s.num_tokens)
                ids.extend(req.all_token_ids[s.start : s.start + s.num_tokens])
                pos.extend(r)
                slots.extend(bt[p // bs] * bs + p % bs for p in r)
            if s.sample:
                sample_idx.append(len(ids) - 1)
        dev = self.device
        attn = AttentionBatch(
            query_lens=[s.num_tokens for s in batch.seqs],
            context_lens=[s.start for s in batch.seqs],
            block_tables=[s.request.block_ids for s in batch.seqs],
            num_decodes=num_decodes,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_size=bs,
        )
        meta = self.backend.plan(attn, dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return input_ids, positions, meta, sample_idx

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch, all_tokens: bool = False) -> torch.Tensor:
        """Logits of the sampling rows (in batch order), or of every token when all_tokens (tests)."""
        input_ids, positions, meta, sample_idx = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not all_tokens:
            hidden = hidden[torch.tensor(sample_idx, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        out = RunnerOutput()
        sampling = [s.request for s in batch.seqs if s.sample]
        logits = self.compute_logits(batch)
        if not sampling:
            return out
        rows = [
            SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.eos_token_ids) for r in sampling
        ]
        result = self.sampler(logits, rows)
        for req, tok, lp in zip(sampling, result.token_ids, result.logprobs):
            out.sampled[req.request_id] = tok
            if lp is not None:
                out.logprobs[req.request_id] = lp
        return out
