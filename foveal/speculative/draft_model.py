"""The draft-model proposer: a smaller (or quantized) model sharing the target's tokenizer runs k greedy
steps per engine step, before the target's verify pass, and proposes what it produced.

It owns its own KV pool (same block size, as many tokens as the target's pool), a ModelRunner over
it, and per request what it has fed (`fed`: token ids whose K/V sit in its pool). Each propose():

    1. catch up   fed vs the request's tokens: keep the common prefix (rewind the rest: rejected
                  drafts), then one chunk with every token it has not seen (a new prompt: all of it)
    2. k - 1 more one-token steps, each feeding the token the step before drew (on the device: the
                  runner's token buffer, so the k steps queue without a host sync between them)
    3. collect    the k drawn tokens per row

Greedy drafts make the proposer deterministic: verification treats q as one-hot on each draft, which
is lossless for sampled rows too (acceptance is p(draft) there, less than a q-aware test would give).
A row the draft pool cannot hold gets no drafts this step (its state is dropped and rebuilt later).
"""

from __future__ import annotations

import logging

from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.request import Request, SamplingParams
from foveal.sched.batch import NewRequest, ScheduledBatch, ScheduledItem
from foveal.speculative.proposer import ProposeRow

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftModelProposer:
    tap = None

    def __init__(self, runner, kv: KVCacheManager, num_speculative_tokens: int, vocab_size: int):
        self.runner = runner  # a ModelRunner over the draft model and its own KV pool
        self.kv = kv
        self.num_speculative_tokens = num_speculative_tokens
        self.vocab_size = vocab_size
        self._state: dict[str, Request] = {}  # request id -> the draft's view (all_token_ids = fed)
        self._verified: dict[str, int] = {}  # request id -> leading fed tokens known to be the request's

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        batch = ScheduledBatch()
        live: list[tuple[int, Request, int]] = []  # (row index, state, drafts wanted)
        for i, row in enumerate(rows):
            k = min(row.max_drafts, self.num_speculative_tokens)
            st = self._catch_up(row, k, batch)
            if st is not None:
                live.append((i, st, k))
        out: list[list[int]] = [[] for _ in rows]
        if not live:
            return out
        batch.items.sort(key=lambda s: not s.is_decode)  # the attention layout: decodes first
        steps = [self.runner.launch(batch)]
        for j in range(1, max(k for _, _, k in live)):
            step = ScheduledBatch()
            for _, st, k in live:
                if j < k:
                    p = st.num_computed_tokens
                    step.items.append(_item(st, p, (), 1, 1))
                    st.num_computed_tokens = p + 1
            steps.append(self.runner.launch(step))
        drawn: dict[str, list[int]] = {}
        for launched in steps:
            for rid, toks in self.runner.collect(launched).tokens.items():
                drawn.setdefault(rid, []).extend(toks)
        for i, st, k in live:
            d = drawn.get(st.request_id, [])[:k]
            out[i] = d
            st.all_token_ids.extend(d[:-1])  # the last draft was never fed
        return out

    def _catch_up(self, row: ProposeRow, k: int, batch: ScheduledBatch) -> Request | None:
        """Rewind the request's draft state to what still matches, allocate room for the unseen tokens
        and k - 1 drafts, and add the catch-up chunk to `batch`; None when the pool cannot hold it."""
        toks = row.token_ids
        st = self._state.get(row.request_id)
        if st is None:
            st = Request(row.request_id, [], _GREEDY)
            self._state[row.request_id] = st
            batch.new_requests.append(NewRequest(row.request_id, (), _GREEDY, frozenset()))
        fed = st.all_token_ids
        p = min(st.num_computed_tokens, len(toks) - 1)  # at least the last token is fed again
        q = min(self._verified.get(row.request_id, 0), p)  # fed[:q] is known to match: scan the rest
        while q < p and fed[q] == toks[q]:
            q += 1
        self._verified[row.request_id] = q
        if q < st.num_computed_tokens:
            self.kv.rewind(st, q)
            del fed[q:]
        n = len(toks) - q
        if not self.kv.can_allocate(st, n + k - 1):
            self.kv.free(st)
            del fed[:]
            st.num_computed_tokens = 0
            self._verified[row.request_id] = 0
            return None
        self.kv.allocate(st, n + k - 1)
        fed.extend(toks[q:])
        batch.items.append(_item(st, q, tuple(toks[q:]), 1, 0))
        st.num_computed_tokens = len(toks)
        return st

    def accepted(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        pass  # the next propose() compares what it fed with the request's tokens

    def finish(self, request_id: str) -> None:
        st = self._state.pop(request_id, None)
        self._verified.pop(request_id, None)
        if st is not None:
            self.kv.free(st)
            self.runner.release([request_id])


def _item(
    st: Request, start: int, token_ids: tuple[int, ...], num_logits: int, pending: int
) -> ScheduledItem:
    return ScheduledItem(
        st.request_id, start, token_ids, st.block_table, num_logits=num_logits, num_pending=pending
    )


def build_draft_proposer(
    spec, *, device, dtype, backend, max_model_len: int, num_blocks: int, block_size: int
):
    """Load the draft checkpoint (its GGUF weights as stored with quantization gguf, on CPUs) and give
    it a KV pool of num_blocks blocks."""
    from foveal.attention import kv_quant
    from foveal.layers import quant
    from foveal.loader import load_checkpoint
    from foveal.models import build_model
    from foveal.worker.model_runner import ModelRunner

    if spec.dtype != "auto":
        from foveal.engine.factory import resolve_dtype

        dtype = resolve_dtype(spec.dtype, device)
    keep = quant.TYPES if quant.runs_packed(spec.quantization, device, dtype) else ()
    ckpt = load_checkpoint(spec.model, dtype=dtype, device=device, keep_blocks=keep)
    k = spec.num_speculative_tokens
    model = build_model(
        ckpt.hf_config,
        backend,
        max_positions=max_model_len + k,
        dtype=dtype,
        device=device,
        weights=ckpt.weights,
    )
    if model.is_multimodal:
        raise ValueError("a draft model must be a text model")
    layers, kv_heads, head_dim = model.kv_shape
    caches = kv_quant.allocate_kv_caches(
        "auto", layers, num_blocks * block_size, kv_heads, head_dim, dtype, device
    )
    vocab = ckpt.hf_config.get_text_config().vocab_size
    runner = ModelRunner(model, caches, backend, block_size, device, vocab, max_tokens_per_row=1)
    log.info(
        "draft model %s (%s): %d KV blocks, %d drafts per step; %s",
        ckpt.name,
        ckpt.format,
        num_blocks,
        k,
        quant.describe(model),
    )
    return DraftModelProposer(runner, KVCacheManager(num_blocks, block_size), k, vocab)
