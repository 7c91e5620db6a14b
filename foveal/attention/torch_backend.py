"""Paged attention in plain PyTorch: works on CPU and CUDA and is the oracle for faster backends.

Cache layout per layer: [2 (K,V), num_blocks * block_size slots, num_kv_heads, head_dim]. A token at
position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.

    block_table = [7, 2]        block 7: slots 112..127 hold positions 0..15
    block_size  = 16            block 2: slots  32..47  hold positions 16..31

Decode rows are batched: their blocks are gathered whole (index_select over block ids, ~7x faster on
CPU than per-slot indexing) into [D, nblk * block_size] (padded with the null block, masked) and
attended in one SDPA call, with the query heads that share a KV head folded into the query-length
axis (GQA without repeating K/V). Prefill chunks go one sequence at a time: a fresh prompt attends its
own K/V causally; a later chunk gathers its context blocks and uses an offset causal mask.

Sliding windows and bidirectional spans (see base.py for the rule) get explicit masks. The layout for
a window is built by the first layer that asks for it and shared by the step's other layers with that
window. A window that hides no key of a sequence changes nothing, so that sequence keeps the plain
layout (short prompts stay on the fast paths); where it does hide keys, only the blocks it reaches are
gathered:

    window 6, block_size 4, decode at position 13:  keys 8..13  ->  gather blocks 2 and 3 only
    positions  0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13
               -------   -------   ---------   -----
               skipped   skipped   gathered    gathered (slots past 13 masked)

A quantized pool (QuantizedKVCache, `--kv-cache-dtype fp8|int8`) has the same slots: k/v are quantized
as they are written, and the gathered blocks (values and their scales) are dequantized to the query
dtype before SDPA. Its values are in the pool's basis (int8: Hadamard-rotated), so the queries are
rotated in and the output back out. A plain tensor pool takes the unquantized path, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from foveal.attention.base import AttentionBatch
from foveal.attention.kv_quant import QuantizedKVCache, dequantize


@dataclass(slots=True)
class _Seq:
    """What plan keeps of one sequence to build windowed layouts on demand."""

    ctx: int  # tokens already cached
    q_len: int
    table: list[int]
    spans: list[tuple[int, int]]  # bidirectional spans that overlap this step's queries


@dataclass(slots=True)
class _Decode:
    blocks: torch.Tensor  # [D * nblk] block ids, row-major (padded with the null block)
    mask: torch.Tensor  # [D, 1, 1, nblk * block_size] bool (True = attend)
    bias: torch.Tensor | None = None  # the mask as 0/-inf in the model dtype, made by the first layer


@dataclass(slots=True)
class _Prefill:
    start: int
    q_len: int
    blocks: torch.Tensor | None  # block ids holding the keys; None: the chunk's own K/V are the keys
    mask: torch.Tensor | None  # [q_len, keys] bool (True = attend); None: plain causal over own K/V


@dataclass(slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    block_size: int
    num_decodes: int
    decode: _Decode | None
    prefills: list[_Prefill]
    seqs: list[_Seq]
    device: torch.device
    windowed: dict[int, tuple[_Decode | None, list[_Prefill]]] = field(default_factory=dict)
    extra: Any = None  # what a backend built on this one plans for itself (cpu_backend: decode tables)


def _allowed(q0: int, q_len: int, k0: int, k_len: int, spans, window: int | None) -> torch.Tensor:
    """[q_len, k_len] bool: may the query at position q0+i see the key at position k0+j."""
    qp = torch.arange(q0, q0 + q_len)[:, None]
    kp = torch.arange(k0, k0 + k_len)[None, :]
    ok = kp <= qp
    end = q0 + q_len  # keys past the chunk are not in the cache yet
    for a, b in spans:
        b = min(b, end)
        ok |= (qp >= a) & (qp < b) & (kp >= a) & (kp < b)
    if window is not None:
        ok &= kp > qp - window
    return ok


def _decode_layout(seqs: list[_Seq], bs: int, window: int | None, device) -> _Decode:
    lens = [s.ctx + 1 for s in seqs]
    lows = [0 if window is None else max(0, n - window) for n in lens]  # first visible position
    first = [lo // bs for lo in lows]
    count = [(n + bs - 1) // bs - f for n, f in zip(lens, first)]
    nblk = max(count)
    ids = [b for s, f, c in zip(seqs, first, count) for b in s.table[f : f + c] + [0] * (nblk - c)]
    pos = torch.arange(nblk * bs)[None, :] + (torch.tensor(first) * bs)[:, None]
    mask = (pos >= torch.tensor(lows)[:, None]) & (pos < torch.tensor(lens)[:, None])
    blocks = torch.tensor(ids, dtype=torch.long).to(device)
    return _Decode(blocks, mask.view(len(seqs), 1, 1, nblk * bs).to(device))


def _prefill_layout(s: _Seq, start: int, bs: int, window: int | None, device) -> _Prefill:
    if s.ctx == 0:
        if window is None and not s.spans:
            return _Prefill(start, s.q_len, None, None)
        return _Prefill(start, s.q_len, None, _allowed(0, s.q_len, 0, s.q_len, s.spans, window).to(device))
    total = s.ctx + s.q_len
    n = (total + bs - 1) // bs
    first = 0 if window is None else max(0, s.ctx - window + 1) // bs  # blocks before it are all hidden
    blk = torch.tensor(s.table[first:n], dtype=torch.long).to(device)
    mask = _allowed(s.ctx, s.q_len, first * bs, (n - first) * bs, s.spans, window).to(device)
    return _Prefill(start, s.q_len, blk, mask)


def _layout(meta: TorchAttentionMetadata, window: int | None) -> tuple[_Decode | None, list[_Prefill]]:
    """The decode and prefill layouts for `window`, built once per step and window."""
    if window is None:
        return meta.decode, meta.prefills
    found = meta.windowed.get(window)
    if found is None:
        nd, bs = meta.num_decodes, meta.block_size
        decode = meta.decode
        if nd and any(s.ctx + 1 > window for s in meta.seqs[:nd]):
            decode = _decode_layout(meta.seqs[:nd], bs, window, meta.device)
        prefills = [
            p if s.ctx + s.q_len <= window else _prefill_layout(s, p.start, bs, window, meta.device)
            for s, p in zip(meta.seqs[nd:], meta.prefills)
        ]
        found = meta.windowed[window] = (decode, prefills)
    return found


def _attend(
    q, k, v, mask, causal: bool, scale: float, softcap: float | None, gqa: bool, sinks=None
) -> torch.Tensor:
    """`sinks`: per-head logits broadcast against the scores' [..., heads, queries, 1]: one more column
    in every softmax, whose value is zero (gpt-oss's attention sinks)."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    # SDPA cannot cap logits (Gemma 2 style) nor take sinks: plain math, scores capped before the mask
    if k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        return torch.matmul(probs.to(q.dtype), v)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _store_quantized(cache: QuantizedKVCache, k, v, meta: TorchAttentionMetadata):
    """Write this step's k/v into a quantized pool; returns the k/v a fresh prompt attends to (in the
    pool's basis, as the gathered blocks are).

    Unlike vLLM (whose fresh prompts attend the unquantized k/v of the step), a fresh prompt here sees
    the same quantized values that every later read gathers, so chunked == unchunked and a prefix hit ==
    a miss keep holding (up to float rounding) under quantization; the round trip costs one dequantize.
    """
    (kq, ks), (vq, vs) = cache.store(meta.slot_mapping, k, v)
    if all(s.ctx for s in meta.seqs[meta.num_decodes :]):
        return k, v  # every query reads its keys back from the pool
    return dequantize(kq, ks, k.dtype), dequantize(vq, vs, v.dtype)


class TorchAttentionBackend:
    name = "torch"

    def plan(self, batch: AttentionBatch, device: torch.device) -> TorchAttentionMetadata:
        bs = batch.block_size
        nd = batch.num_decodes
        spans = batch.bidirectional or [()] * len(batch.query_lens)
        seqs = []
        for q_len, ctx, table, sp in zip(batch.query_lens, batch.context_lens, batch.block_tables, spans):
            overlapping = [(a, b) for a, b in sp if a < ctx + q_len and b > ctx and b - a > 1]
            seqs.append(_Seq(ctx, q_len, list(table), overlapping))
        decode = _decode_layout(seqs[:nd], bs, None, device) if nd else None
        prefills = []
        start = nd
        for s in seqs[nd:]:
            prefills.append(_prefill_layout(s, start, bs, None, device))
            start += s.q_len
        return TorchAttentionMetadata(batch.slot_mapping, bs, nd, decode, prefills, seqs, device)

    def _store(self, k_cache, v_cache, slots, k, v) -> None:
        """This step's k / v [T, kv_heads, head_dim] into pool rows `slots` [T]."""
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def _rows_in_place(self, q, kv_cache, meta, out, scale, window, softcap, sinks=None) -> int:
        """Hook for backends built on this one: attend the step's first n rows (its decode rows, or all
        of them) into `out` and return n; the rows after them take the gather + SDPA path below (the
        oracle)."""
        return 0

    def forward(
        self,
        q,
        k,
        v,
        kv_cache,
        meta: TorchAttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`sinks`: per-head attention-sink logits [num_heads] (gpt-oss), or None."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k.shape[1]
        group = num_heads // num_kv
        quantized = isinstance(kv_cache, QuantizedKVCache)
        if quantized:
            k, v = _store_quantized(kv_cache, k, v, meta)
            q = kv_cache.to_pool_basis(q)  # the pool's K/V come back in its basis (rotated for int8)

            def blocks_of(i: int, ids: torch.Tensor) -> torch.Tensor:
                return kv_cache.gather_blocks(i, ids, meta.block_size, q.dtype)

        else:
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            self._store(k_cache, v_cache, meta.slot_mapping, k, v)
            # whole blocks are gathered with index_select: ~7x faster than per-slot advanced indexing on CPU
            k_blocks = k_cache.view(-1, meta.block_size, num_kv, head_dim)
            v_blocks = v_cache.view(-1, meta.block_size, num_kv, head_dim)

            def blocks_of(i: int, ids: torch.Tensor) -> torch.Tensor:
                return (k_blocks, v_blocks)[i].index_select(0, ids)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        done = self._rows_in_place(q, kv_cache, meta, out, scale, window, softcap, sinks)
        if nd > done:
            decode = _layout(meta, window)[0]
            if decode is None:  # graph metadata (cpu_backend) has no gather layout to fall back on
                raise RuntimeError("decode rows planned for the native kernel, which cannot take them")
            # a single-token query never needs its spans: it sees every earlier token anyway
            qd = q[:nd].view(nd, num_kv, group, head_dim)
            kd = blocks_of(0, decode.blocks).view(nd, -1, num_kv, head_dim).transpose(1, 2)
            vd = blocks_of(1, decode.blocks).view(nd, -1, num_kv, head_dim).transpose(1, 2)
            if decode.bias is None or decode.bias.dtype != q.dtype:
                # an additive mask is ~20% faster than a boolean one in the CPU kernel
                bias = torch.zeros(decode.mask.shape, dtype=q.dtype, device=q.device)
                decode.bias = bias.masked_fill_(~decode.mask, float("-inf"))
            sd = None if sinks is None else sinks.view(num_kv, group, 1)
            od = _attend(qd, kd, vd, decode.bias, False, scale, softcap, gqa=False, sinks=sd)
            out[:nd] = od.reshape(nd, num_heads, head_dim)
        for p in _layout(meta, window)[1]:
            if p.start < done:
                continue
            # 4-D inputs ([1, heads, len, dim]) take the CPU flash kernel; 3-D falls back to ~2x slower math
            s, e = p.start, p.start + p.q_len
            qp = q[s:e].transpose(0, 1)[None]
            if p.blocks is None:
                kp, vp = k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None]
            else:
                kp = blocks_of(0, p.blocks).view(-1, num_kv, head_dim).transpose(0, 1)[None]
                vp = blocks_of(1, p.blocks).view(-1, num_kv, head_dim).transpose(0, 1)[None]
            sp = None if sinks is None else sinks.view(num_heads, 1, 1)
            op = _attend(qp, kp, vp, p.mask, p.mask is None, scale, softcap, gqa=True, sinks=sp)
            out[s:e] = op[0].transpose(0, 1)
        return kv_cache.from_pool_basis(out) if quantized else out
