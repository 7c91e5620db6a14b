"""The triton attention backend against the torch backend (its oracle) on identical paged caches and
batches: decode (one and several key splits), fresh prompts, chunks after a context, short multi-token
queries after a context (draft verification), mixed steps, sliding windows, softcap, fp32 and bf16,
GQA groups of 1, 2 and 4, head_dim 48 (not a power of 2), block sizes 4 and 16, shuffled block ids.

Every cache starts as large junk in every slot and q/k/v are views of one fused qkv tensor, so a
mask that lets in a wrong slot, or a stride taken for granted, shows. On CPU the kernels run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with CUDA the same tests run there.
"""

from __future__ import annotations

import math

import pytest
import torch

from foveal.attention import get_backend
from foveal.attention.base import AttentionBatch
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.attention.torch_backend import TorchAttentionBackend
from foveal.attention.triton_backend import TritonAttentionBackend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SCALE = 0.3


class Case:
    """Sequences as (cached context, new tokens), decodes first; a paged cache of junk holding the
    contexts under shuffled block ids; the step's q/k/v (views of one fused tensor) and its batch."""

    def __init__(self, seqs, *, num_kv=2, group=2, head_dim=32, bs=16, dtype=torch.float32, seed=0, nd=None):
        g = torch.Generator().manual_seed(seed)
        self.num_heads = num_kv * group
        need = [math.ceil((c + n) / bs) for c, n in seqs]
        num_blocks = sum(need) + 3  # block 0 stays unused: the padding block of tables
        order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        tables = []
        for n in need:
            tables.append(order[:n])
            order = order[n:]
        self.cache = (torch.randn(2, num_blocks * bs, num_kv, head_dim, generator=g) * 10).to(dtype)
        slots = []
        for (ctx, n), table in zip(seqs, tables):
            pos_slots = [table[p // bs] * bs + p % bs for p in range(ctx + n)]
            self.cache[:, pos_slots[:ctx]] = torch.randn(2, ctx, num_kv, head_dim, generator=g).to(dtype)
            slots.extend(pos_slots[ctx:])
        total = sum(n for _, n in seqs)
        qkv = torch.randn(total, self.num_heads + 2 * num_kv, head_dim, generator=g).to(dtype)
        self.q, self.k, self.v = qkv.split([self.num_heads, num_kv, num_kv], dim=1)
        self.batch = AttentionBatch(
            query_lens=[n for _, n in seqs],
            context_lens=[c for c, _ in seqs],
            block_tables=tables,
            # decodes: the leading one-token rows, unless told (a 1-token verify chunk is a prefill)
            num_decodes=nd
            if nd is not None
            else next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs)),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=bs,
        )
        self.to(DEVICE)

    def to(self, device):
        for name in ("cache", "q", "k", "v"):
            setattr(self, name, getattr(self, name).to(device))
        self.batch.slot_mapping = self.batch.slot_mapping.to(device)
        return self

    def run(self, backend, cache, meta=None, **kw):
        meta = backend.plan(self.batch, DEVICE) if meta is None else meta
        return backend.forward(self.q, self.k, self.v, cache, meta, SCALE, **kw)


def tolerance(dtype):
    return dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def compare(case: Case, backend=None, **kw):
    """Triton == torch on the outputs and on the cache after the store."""
    backend = backend or TritonAttentionBackend()
    c_ref, c_tri = case.cache.clone(), case.cache.clone()
    ref = case.run(TorchAttentionBackend(), c_ref, **kw)
    out = case.run(backend, c_tri, **kw)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(out, ref, **tolerance(case.q.dtype))
    assert torch.equal(c_tri, c_ref), "cache after the store differs"


# (context, new tokens): 17 is no multiple of either block size; 150 crosses several splits
DECODES = [(0, 1), (5, 1), (17, 1), (150, 1)]
FRESH = [(0, 11), (0, 23)]
CHUNKS = [(9, 7), (32, 16)]  # prefix hits / later chunks
VERIFY = [(20, 1), (33, 2), (50, 4)]  # 1..k+1 tokens after a context, in the prefill section
MIXED = [(3, 1), (40, 1), (0, 13), (21, 6), (6, 2)]

SHAPES = [  # num_kv, group, head_dim, block_size
    pytest.param(2, 2, 32, 16, id="kv2g2-d32-bs16"),
    pytest.param(1, 4, 48, 4, id="kv1g4-d48-bs4"),
    pytest.param(2, 1, 32, 4, id="kv2g1-d32-bs4"),
    pytest.param(4, 7, 32, 16, id="kv4g7-d32-bs16"),  # Qwen2.5-VL-7B: 28 heads over 4 KV heads
]


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_decode_matches_torch(num_kv, group, head_dim, bs):
    case = Case(DECODES, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs)
    compare(case, TritonAttentionBackend(max_splits=1))  # the kernel writes the output itself
    compare(case, TritonAttentionBackend(split_tokens=16))  # several splits, short rows in few


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_prefill_matches_torch(num_kv, group, head_dim, bs):
    kw = dict(num_kv=num_kv, group=group, head_dim=head_dim, bs=bs)
    compare(Case(FRESH + CHUNKS, **kw))


def test_short_queries_after_context():
    compare(Case(VERIFY, num_kv=1, group=4, head_dim=48, bs=4, nd=0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_decode_and_prefill(dtype):
    # 30 queries x a group of 4: 128-row prefill tiles (bf16 takes the large-tile launch config)
    case = Case(MIXED + [(0, 30)], group=4, dtype=dtype, seed=1)
    compare(case, TritonAttentionBackend(split_tokens=8))


@pytest.mark.parametrize("window", [1, 5, 16])
def test_sliding_window(window):
    case = Case(DECODES[1:] + [(0, 20), (30, 9)], num_kv=1, group=4, head_dim=48, bs=4, seed=window)
    compare(case, TritonAttentionBackend(split_tokens=16), window=window)


def test_softcap_with_and_without_window():
    case = Case(MIXED, group=4, num_kv=1, seed=3)
    compare(case, softcap=2.0)
    compare(case, TritonAttentionBackend(split_tokens=8), softcap=2.0, window=7)


def test_graph_metadata_matches_plan_and_padding_is_inert():
    backend = TritonAttentionBackend(split_tokens=16)
    case = Case(DECODES[1:], num_kv=1, group=4, head_dim=48, bs=4)
    n, padded, max_seqs = 3, 5, 8
    static = backend.graph_metadata(max_seqs, max_blocks_per_seq=64, block_size=4, device=DEVICE)
    # a first, different batch leaves stale rows behind; the second fill must override them
    backend.fill_graph_metadata(static, Case([(60, 1)] * 6, num_kv=1, group=4, head_dim=48, bs=4).batch, 6)
    meta = backend.fill_graph_metadata(static, case.batch, padded)
    assert meta.decode_block_table.data_ptr() == static.decode_block_table.data_ptr()
    assert meta.num_splits == static.num_splits and meta.num_decodes == padded

    want_cache = case.cache.clone()
    want = case.run(backend, want_cache)
    # padding rows: junk q/k/v (as a padded graph batch has), seq_len 0, slot -1
    q, k, v = (
        torch.cat([x, torch.randn_like(x[:1]).expand(padded - n, -1, -1)]) for x in (case.q, case.k, case.v)
    )
    cache = case.cache.clone()
    out = backend.forward(q, k, v, cache, meta, SCALE)
    torch.testing.assert_close(out[:n], want, atol=2e-5, rtol=1e-5)
    assert torch.isfinite(out[n:]).all()
    assert torch.equal(cache, want_cache), "a padding row wrote the cache"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need CUDA")
def test_cuda_graph_replay_matches_eager():
    backend = TritonAttentionBackend()
    first = Case([(100, 1), (7, 1)], num_kv=2, group=4, head_dim=64, bs=16, dtype=torch.bfloat16)
    second = Case([(300, 1), (0, 1), (33, 1)], num_kv=2, group=4, head_dim=64, bs=16, dtype=torch.bfloat16)
    padded = 4
    static = backend.graph_metadata(8, max_blocks_per_seq=32, block_size=16, device=DEVICE)
    meta = backend.fill_graph_metadata(static, first.batch, padded)
    cache = torch.zeros(2, 64 * 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    cache[:, : first.cache.shape[1]] = first.cache
    sq, sk, sv = (
        torch.zeros(padded, *x.shape[1:], dtype=x.dtype, device=DEVICE) for x in (first.q, first.k, first.v)
    )
    backend.forward(sq, sk, sv, cache, meta, SCALE)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(sq, sk, sv, cache, meta, SCALE)
    # replay with the second batch: new data in the same buffers
    cache[:, : second.cache.shape[1]] = second.cache
    ref_cache = cache.clone()
    want = second.run(TorchAttentionBackend(), ref_cache)
    backend.fill_graph_metadata(static, second.batch, padded)
    for static_x, x in zip((sq, sk, sv), (second.q, second.k, second.v)):
        static_x[:3] = x
    torch.cuda.set_sync_debug_mode("error")  # replay must not sync the host
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out[:3], want, atol=3e-2, rtol=2e-2)
    assert torch.equal(cache, ref_cache)


def test_auto_picks_torch_on_cpu():
    assert get_backend("auto", torch.device("cpu")).name == "torch"
    assert get_backend("triton", DEVICE).name == "triton"


def test_bidirectional_step_falls_back_to_torch():
    case = Case([(7, 1), (0, 14), (8, 10)], num_kv=1, group=4, seed=5)
    case.batch.bidirectional = [[], [(2, 6), (8, 13)], [(10, 15)]]
    c_ref, c_tri = case.cache.clone(), case.cache.clone()
    ref = case.run(TorchAttentionBackend(), c_ref, window=6)
    out = case.run(TritonAttentionBackend(), c_tri, window=6)
    assert torch.equal(out, ref) and torch.equal(c_tri, c_ref)


def test_quantized_cache_falls_back_to_torch():
    case = Case([(7, 1), (0, 9), (5, 6)], num_kv=2, group=2, head_dim=32, bs=4, seed=6)
    outs, pools = [], []
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        pool = QuantizedKVCache("int8", case.cache.shape[1], 2, 32, device=DEVICE)
        meta = backend.plan(case.batch, DEVICE)
        for _ in range(2):  # two layers share the step's (lazily planned) torch metadata
            outs.append(backend.forward(case.q, case.k, case.v, pool, meta, SCALE, softcap=3.0))
        pools.append(pool)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    assert torch.equal(pools[0].data, pools[1].data) and torch.equal(pools[0].scale, pools[1].scale)
