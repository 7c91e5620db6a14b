"""GPU memory sizing: how many bytes the KV pool may take under `--gpu-memory-utilization`.

The pool gets what is left of `utilization * total` after everything else the process will need:

    total * utilization
      - in use now            weights, CUDA context, cuBLAS workspaces, other processes' memory
      - activation headroom   the peak of one profiling step at the largest batch, above what was in
                              use before it: a full-budget prefill, then the LM head and the sampler's
                              worst case (top-p sorts a float32 [max_num_seqs, vocab] matrix)
      - graph reserve         CUDA graphs keep their own memory pool (decode activations, logits)
      = KV pool bytes

Measured, not estimated: the profiling step runs the real model on a throwaway KV cache.
"""

from __future__ import annotations

import logging

import torch

from foveal.attention import kv_quant
from foveal.attention.base import AttentionBatch
from foveal.models.base import StepContext

log = logging.getLogger(__name__)


@torch.inference_mode()
def profile_activation_peak(
    model,
    backend,
    *,
    num_tokens: int,
    num_seqs: int,
    max_len: int,
    block_size: int,
    kv_cache_dtype: str,
    vocab_size: int,
) -> int:
    """Bytes allocated above the current level at the peak of a profiling step (CUDA only): fresh
    prompts of at most max_len tokens (positions past the context would index past the rotary table)
    filling the token budget."""
    from foveal.request import SamplingParams
    from foveal.sample.sampler import Sampler, SamplingRow

    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    layers, kv_heads, head_dim = model.kv_shape
    lens = [min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)]
    tables, nxt = [], 1  # block 0 stays the null block
    for n in lens:
        k = -(-n // block_size)
        tables.append(list(range(nxt, nxt + k)))
        nxt += k
    nblk = nxt
    caches = kv_quant.allocate_kv_caches(
        kv_cache_dtype, layers, nblk * block_size, kv_heads, head_dim, dtype, dev
    )
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    slots = [t[p // block_size] * block_size + p % block_size for n, t in zip(lens, tables) for p in range(n)]
    batch = AttentionBatch(
        query_lens=lens,
        context_lens=[0] * len(lens),
        block_tables=tables,
        num_decodes=0,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        block_size=block_size,
    )
    meta = backend.plan(batch, dev)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    positions = torch.cat([torch.arange(n) for n in lens]).to(dev)
    hidden = model(ids, StepContext(positions, caches, meta))
    logits = model.compute_logits(hidden[-1:].expand(num_seqs, -1).contiguous())
    del hidden
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    Sampler(vocab_size)(logits, [SamplingRow(params, [], [], frozenset())] * num_seqs)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del logits, caches, meta
    torch.cuda.empty_cache()
    return peak


def kv_pool_bytes(device: torch.device, utilization: float, activation_peak: int, graph_reserve: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = int(total * utilization) - in_use - activation_peak - graph_reserve
    log.info(
        "GPU memory: %.1f GiB total x %.2f; in use %.1f GiB (weights, context, others); activation peak "
        "%.2f GiB; graph reserve %.2f GiB; KV pool %.1f GiB",
        total / 2**30,
        utilization,
        in_use / 2**30,
        activation_peak / 2**30,
        graph_reserve / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV pool: {in_use / 2**30:.1f} GiB in use and a "
            f"{activation_peak / 2**30:.2f} GiB activation peak exceed --gpu-memory-utilization "
            f"{utilization} of {total / 2**30:.1f} GiB; raise it, or lower --max-num-batched-tokens / "
            "--max-num-seqs"
        )
    return budget
