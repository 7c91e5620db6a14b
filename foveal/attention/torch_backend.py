"""Paged attention in plain PyTorch: works on CPU and CUDA and is the oracle for faster backends.

Cache layout per layer: [2 (K,V), num_blocks * block_size slots, num_kv_heads, head_dim]. A token at
position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.

    block_table = [7, 2]        block 7: slots 112..127 hold positions 0..15
    block_size  = 16            block 2: slots  32..47  hold positions 16..31

Decode rows are batched: their K/V are gathered into [D, Lmax] (padded, masked) and attended in one
SDPA call, with the query heads that share a KV head folded into the query-length axis (GQA without
repeating K/V). Prefill chunks go one sequence at a time: a fresh prompt attends its own K/V causally;
a later chunk gathers its context from the cache and uses an offset causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foveal.attention.base import AttentionBatch


@dataclass(slots=True)
class _Prefill:
    start: int
    q_len: int
    gather: torch.Tensor | None  # [ctx + q_len] slots; None when the chunk has no cached context
    mask: torch.Tensor | None  # [q_len, ctx + q_len] bool (True = attend)


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_gather: torch.Tensor | None  # [D, Lmax] slots
    decode_mask: torch.Tensor | None  # [D, 1, 1, Lmax] bool
    prefills: list[_Prefill]
    decode_bias: torch.Tensor | None = None  # the mask as 0/-inf in the model dtype, made by layer 0


def _slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.long)
    return (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:length]


class TorchAttentionBackend:
    name = "torch"

    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        bs = batch.block_size
        nd = batch.num_decodes
        gather = mask = None
        if nd:
            lens = [c + 1 for c in batch.context_lens[:nd]]
            lmax = max(lens)
            nblk = (lmax + bs - 1) // bs
            table = torch.zeros(nd, nblk, dtype=torch.long)
            for i, bt in enumerate(batch.block_tables[:nd]):
                used = bt[: (lens[i] + bs - 1) // bs]
                table[i, : len(used)] = torch.tensor(used, dtype=torch.long)
            gather = (table[:, :, None] * bs + torch.arange(bs)).view(nd, -1)[:, :lmax]
            mask = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
            gather, mask = gather.to(device), mask.view(nd, 1, 1, lmax).to(device)
        prefills = []
        start = nd
        for i in range(nd, len(batch.query_lens)):
            q_len, ctx = batch.query_lens[i], batch.context_lens[i]
            g = m = None
            if ctx:
                total = ctx + q_len
                g = _slots(batch.block_tables[i], total, bs).to(device)
                m = (torch.arange(total)[None, :] <= torch.arange(ctx, total)[:, None]).to(device)
            prefills.append(_Prefill(start, q_len, g, m))
            start += q_len
        return TorchAttentionMetadata(batch.slot_mapping, nd, gather, mask, prefills)

    def forward(self, q, k, v, kv_cache, meta: TorchAttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k.shape[1]
        group = num_heads // num_kv
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            qd = q[:nd].view(nd, num_kv, group, head_dim)
            kd = k_cache[meta.decode_gather].transpose(1, 2)  # [D, kv, L, hd]
            vd = v_cache[meta.decode_gather].transpose(1, 2)
            if meta.decode_bias is None or meta.decode_bias.dtype != q.dtype:
                # an additive mask is ~20% faster than a boolean one in the CPU kernel
                bias = torch.zeros(meta.decode_mask.shape, dtype=q.dtype, device=q.device)
                meta.decode_bias = bias.masked_fill_(~meta.decode_mask, float("-inf"))
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_bias, scale=scale)
            out[:nd] = od.reshape(nd, num_heads, head_dim)
        for p in meta.prefills:
            # 4-D inputs ([1, heads, len, dim]): the CPU flash kernel takes them; 3-D falls back to ~2x slower math
            s, e = p.start, p.start + p.q_len
            qp = q[s:e].transpose(0, 1)[None]
            if p.gather is None:
                kp, vp = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)
            else:
                kp, vp = k_cache[p.gather].transpose(0, 1)[None], v_cache[p.gather].transpose(0, 1)[None]
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=True)
            out[s:e] = op[0].transpose(0, 1)
        return out
