"""The triton attention backend against the torch backend (its oracle) on identical paged caches and
batches: decode (one and several key splits), fresh prompts, chunks after a context, short multi-token
queries after a context (draft verification), mixed steps, sliding windows, softcap, fp32 and bf16,
GQA groups of 1, 2 and 4, head_dim 48 (not a power of 2), block sizes 4 and 16, shuffled block ids.

Every cache starts as large junk in every slot and q/k/v are views of one fused qkv tensor, so a
mask that lets in a wrong slot, or a stride taken for granted, shows. On CPU the kernels run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with CUDA the same tests run there.
"""

from __future__ import annotations

import pytest
import torch

from foveal.attention import get_backend
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.attention.torch_backend import TorchAttentionBackend
from foveal.attention.triton_backend import TritonAttentionBackend
from tests.attention_cases import CHUNKS, DECODES, DEVICE, FRESH, MIXED, SCALE, SHAPES, VERIFY, Case, compare


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_decode_matches_torch(num_kv, group, head_dim, bs):
    case = Case(DECODES, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs)
    compare(case, TritonAttentionBackend(max_splits=1))  # the kernel writes the output itself
    compare(case, TritonAttentionBackend(split_tokens=16))  # several splits, short rows in few


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_prefill_matches_torch(num_kv, group, head_dim, bs):
    kw = dict(num_kv=num_kv, group=group, head_dim=head_dim, bs=bs)
    compare(Case(FRESH + CHUNKS, **kw), TritonAttentionBackend())


def test_short_queries_after_context():
    compare(Case(VERIFY, num_kv=1, group=4, head_dim=48, bs=4, nd=0), TritonAttentionBackend())


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
    compare(case, TritonAttentionBackend(), softcap=2.0)
    compare(case, TritonAttentionBackend(split_tokens=8), softcap=2.0, window=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_sinks(dtype):
    """gpt-oss's per-head sinks in the decode kernel (one split and several: counted once) and the
    prefill kernel, with and without a window."""
    case = Case([(150, 1), (3, 1), (40, 1)] + MIXED[2:] + [(0, 30)], group=4, num_kv=2, dtype=dtype, seed=9)
    sinks = torch.linspace(-3.0, 6.0, 8, device=case.device).to(dtype)
    compare(case, TritonAttentionBackend(), sinks=sinks)
    compare(case, TritonAttentionBackend(split_tokens=8), sinks=sinks)
    compare(case, TritonAttentionBackend(split_tokens=8), sinks=sinks, window=7)


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


def test_auto_picks_triton_only_on_cuda():
    assert get_backend("auto", torch.device("cpu")).name in ("cpu", "torch")  # tests/test_cpu_attention.py
    assert get_backend("triton", DEVICE).name == "triton"


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bidirectional_spans_in_the_prefill_kernel(window, dtype):
    """Spans (Gemma 3's images; a masked diffusion model's whole sequence; several in a chunk, one
    reaching back into the cached context) run in the prefill kernel, as the torch backend masks them."""
    case = Case([(7, 1), (0, 14), (8, 10), (0, 40), (0, 9)], num_kv=1, group=4, seed=5, dtype=dtype)
    case.batch.bidirectional = [[], [(2, 6), (8, 13)], [(5, 15)], [(0, 40)], [(0, 4), (4, 8), (8, 9)]]
    compare(case, TritonAttentionBackend(), window=window)
    meta = TritonAttentionBackend().plan(case.batch, DEVICE)
    assert meta.fallback is None and meta.query_limits is not None  # no torch fallback any more


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
