"""The triton attention backend against the torch backend (its oracle) on identical paged caches and
batches: decode (one and several key splits), fresh prompts, chunks after a context, short multi-token
queries after a context (draft verification), mixed steps, sliding windows, softcap, fp32 and bf16,
GQA groups of 1, 2 and 4, head_dim 48 (not a power of 2), block sizes 4 and 16, shuffled block ids;
fp8 / int8 quantized pools (the kernels dequantize as they gather) against the torch backend on equal
pools.

Every cache starts as large junk in every slot and q/k/v are views of one fused qkv tensor, so a
mask that lets in a wrong slot, or a stride taken for granted, shows. On CPU the kernels run in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1); with CUDA the same tests run there.
"""

from __future__ import annotations

import numpy as np
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


@pytest.mark.parametrize("name", ["triton", "cpu"])
def test_shifted_graph_metadata_equals_a_fill_at_the_shifted_contexts(name):
    """Rows moved s positions on in filled graph metadata, on the device (a chain head that follows a
    verify step by its accepted counts), get the lengths and slots a fill at context + s gives; the
    padding row keeps writing and reading nothing."""
    from foveal.attention.base import AttentionBatch

    if name == "cpu":
        from foveal.attention import cpu_native
        from foveal.attention.cpu_backend import CpuAttentionBackend

        if DEVICE.type != "cpu" or cpu_native.kernel() is None:
            pytest.skip("the CPU backend's graphs: a CPU device with the native kernel")
        backend = CpuAttentionBackend()
    else:
        backend = TritonAttentionBackend()
    bs, tables, ctxs, shifts = 4, [[3, 9, 4, 7], [11, 2, 8], [5, 6, 1, 12, 10]], [5, 2, 9], [3, 0, 7]

    def filled(contexts):
        meta = backend.fill_graph_metadata(static, AttentionBatch([1] * 3, contexts, tables, 3, None, bs), 4)
        lens = meta.decode_seq_lens if name == "triton" else meta.extra.lens
        return meta, meta.slot_mapping, lens

    static = backend.graph_metadata(8, 16, bs, DEVICE)
    _, slots, lens = filled([c + s for c, s in zip(ctxs, shifts)])
    want = slots.tolist(), lens.tolist()
    meta, slots, lens = filled(ctxs)
    assert slots.tolist() != want[0]
    backend.shift_graph_metadata(meta, 3, torch.tensor(shifts, device=DEVICE))
    assert (slots.tolist(), lens.tolist()) == want
    nothing = -1 if name == "triton" else 0  # a row that writes no key (the CPU's null block)
    assert want[1][3] == 0 and want[0][3] == nothing  # the padding row
    # keys given by index (a DFlash block's rows: not at their last key; < 0: a row that writes none)
    meta, slots, lens = filled(ctxs)
    backend.shift_graph_metadata(
        meta, 3, torch.tensor(shifts, device=DEVICE), torch.tensor([-1, 5, 13], device=DEVICE)
    )
    assert slots.tolist()[:3] == [nothing, 2 * bs + 1, 12 * bs + 1] and lens.tolist() == want[1]


def test_block_table_rows_equal_a_fresh_conversion_across_calls():
    """_TableRows keeps a tuple's row across calls and converts a list at each call (once however many
    rows share it): every call equals converting fresh copies, lengths included. A list changed in
    place between calls is read as it is now; a table given again after its generation was dropped is
    converted again, to the same values."""
    from foveal.attention.triton_backend import _TableRows

    def fresh(tables, width):
        out = np.zeros((len(tables), width), dtype=np.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = t
        return out, [len(t) for t in tables]

    rows = _TableRows(cap=4)
    a, b, c, d = (5, 6, 7), [1, 2], (9, 8, 7, 6, 5), ()
    calls = [[a, a, a, b, c, c, b, d], [c, b, a], [a, (5, 6, 7, 4), b, b]]
    for i, tables in enumerate(calls + calls):
        if i == 2:
            b.append(3)  # in place: the next calls must see it
        got = rows.array(tables, 8)
        want = fresh(tables, 8)
        assert np.array_equal(got[0], want[0]) and got[1].tolist() == want[1], i
    assert rows.array([], 8)[0].shape == (0, 8)


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
    assert meta.query_limits is not None


# -- quantized pools (kv_quant.py): the kernels dequantize as they gather -------------------------------


def quantized(case: Case, kind: str) -> QuantizedKVCache:
    """The case's cache (context and junk alike) written into a quantized pool."""
    _, slots, num_kv, head_dim = case.cache.shape
    pool = QuantizedKVCache(kind, slots, num_kv, head_dim, device=case.device)
    pool.store(torch.arange(slots, device=case.device), case.cache[0], case.cache[1])
    return pool


def compare_quantized(case: Case, backend, kind: str, meta=None, q=None, k=None, v=None, **kw):
    """backend on a quantized pool == the torch backend on an equal one (the outputs, and the codes and
    scales after the step's store): both read the same dequantized values. `meta` / q, k, v: a padded
    graph batch's (its rows past the case's are padding)."""
    want_pool, pool = quantized(case, kind), quantized(case, kind)
    want = TorchAttentionBackend().forward(
        case.q, case.k, case.v, want_pool, TorchAttentionBackend().plan(case.batch, case.device), SCALE, **kw
    )
    meta = backend.plan(case.batch, case.device) if meta is None else meta
    q, k, v = (case.q, case.k, case.v) if q is None else (q, k, v)
    out = backend.forward(q, k, v, pool, meta, SCALE, **kw)
    # bf16: the plain pool's tolerance, twice its atol for int8, whose output is rotated back after
    # rounding, mixing 16-64 channels' rounding differences into each (seen: 0.037 once in 15,616)
    tol = dict(atol=2e-5, rtol=1e-5) if case.q.dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    if kind == "int8" and case.q.dtype == torch.bfloat16:
        tol["atol"] = 6e-2
    torch.testing.assert_close(out[: len(want)], want, **tol)
    assert torch.isfinite(out).all()
    assert torch.equal(pool.scale, want_pool.scale), "the stored scales differ"
    assert torch.equal(pool.codes, want_pool.codes), "the stored codes differ"


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_pools_read_in_the_kernels(kind, dtype):
    """Decode rows (one split and several), fresh prompts, chunks after a context, short queries, with
    windows, softcap and sinks; head_dim 48 (int8: a rotation of 3 blocks of 16, two scale groups of
    24) and 64 (int8: one Hadamard block, two groups of 32)."""
    seqs = [(150, 1), (3, 1), (40, 1)] + MIXED[2:] + [(0, 30)] + VERIFY
    for num_kv, group, head_dim, bs in ((1, 4, 48, 4), (2, 2, 64, 16)):
        case = Case(seqs, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs, dtype=dtype, seed=11)
        sinks = torch.linspace(-3.0, 6.0, num_kv * group, device=case.device).to(dtype)
        compare_quantized(case, TritonAttentionBackend(), kind)
        compare_quantized(case, TritonAttentionBackend(split_tokens=8), kind, window=7, softcap=3.0)
        compare_quantized(case, TritonAttentionBackend(max_splits=1), kind, sinks=sinks)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_pools_through_graph_metadata_and_shared_prefixes(kind):
    """A padded graph batch (its padding rows store nothing: the codes and scales equal the torch
    backend's, which never sees them) and rows grouped behind a shared prefix, both reading the pool's
    codes through the same kernels."""
    from tests.test_shared_prefix import GROUPS, SEQS, shared_case

    backend = TritonAttentionBackend(split_tokens=16, shared_min_rows=3, shared_min_prefix=4)
    static = backend.graph_metadata(32, max_blocks_per_seq=64, block_size=4, device=DEVICE)

    def padded_run(case, padded, shared=False):
        n = len(case.batch.query_lens)
        meta = backend.fill_graph_metadata(static, case.batch, padded, shared=shared)
        q, k, v = (
            torch.cat([x, torch.randn_like(x[:1]).expand(padded - n, -1, -1)])
            for x in (case.q, case.k, case.v)
        )
        compare_quantized(case, backend, kind, meta=meta, q=q, k=k, v=v)
        return meta

    padded_run(Case(DECODES[1:], num_kv=1, group=4, head_dim=48, bs=4), 5)
    case = shared_case(SEQS, GROUPS, num_kv=2, group=2, head_dim=64, bs=4, seed=4)
    assert backend.plan(case.batch, case.device).shared is not None
    compare_quantized(case, backend, kind)  # eager
    meta = padded_run(case, len(SEQS) + 2, shared=True)
    assert int((meta.shared.prefix_lens > 0).sum()) == 21


def _launch_keys(monkeypatch) -> list:
    """Records, instead of running them, the decode, combine and shared-prefix kernels' launches: each
    as (kernel, Triton's specialization of every argument, the constants), what picks the compiled
    variant (the interpreter keeps the kernels' do-not-specialize lists; a GPU run reads the same)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    from foveal.attention.kernels import decode, shared_prefix

    keys = []

    def recorder(kernel, name):
        opts = getattr(kernel, "kwargs", None) or vars(kernel)
        free, unaligned = (
            set(opts.get(k) or ()) for k in ("do_not_specialize", "do_not_specialize_on_alignment")
        )

        def launch(*args, **constants):
            spec = tuple(
                native_specialize_impl(BaseBackend, arg, False, n not in free, n not in unaligned)
                for n, arg in zip(kernel.arg_names, args)
            )
            keys.append((name, spec, tuple(sorted(constants.items()))))

        return type("Recorder", (), {"__getitem__": lambda self, grid: launch})()

    for module, name in (
        (decode, "_decode_kernel"),
        (decode, "_combine_kernel"),
        (shared_prefix, "_shared_prefix_kernel"),
    ):
        monkeypatch.setattr(module, name, recorder(getattr(module, name), name))
    return keys


@pytest.mark.parametrize("shared", [False, True], ids=["plain", "shared-prefixes"])
@pytest.mark.parametrize("max_splits", [1, 2], ids=["direct", "split"])
def test_graph_and_eager_steps_launch_the_same_kernel_variants(monkeypatch, shared, max_splits):
    """An eager step's decode launches specialize as a graph's of the same split count do, so the
    variants compiled for the start-up's graphs serve the eager (mixed) steps of the first requests: a
    variant of their own compiled mid-traffic, delaying every request's first token (W4 on a fresh H100,
    session 44). The lengths and tables sit aligned in an eager step's packed metadata and not in a
    graph's static rows, and their stride is 1 only in the former."""
    from tests.test_shared_prefix import GROUPS, SEQS, shared_case

    backend = TritonAttentionBackend(
        split_tokens=16, max_splits=max_splits, shared_min_rows=3 if shared else 0, shared_min_prefix=4
    )
    case = shared_case(SEQS, GROUPS, num_kv=2, group=2, head_dim=64, bs=4, seed=4)
    n = len(SEQS)
    static = backend.graph_metadata(32, max_blocks_per_seq=64, block_size=4, device=DEVICE)
    eager = backend.plan(case.batch, case.device)
    graph = backend.fill_graph_metadata(static, case.batch, n, shared=shared)
    assert (eager.shared is not None) == shared
    keys = _launch_keys(monkeypatch)
    launched = []
    for meta in (eager, graph):
        keys.clear()
        backend.forward(case.q, case.k, case.v, case.cache.clone(), meta, SCALE)
        launched.append(list(keys))
    names = [k[0] for k in launched[0]]
    want = (
        ["_decode_kernel"]
        + ["_shared_prefix_kernel"] * shared
        + ["_combine_kernel"] * (shared or max_splits > 1)
    )
    assert names == want and [k[0] for k in launched[1]] == want
    for (name, eager_spec, eager_consts), (_, graph_spec, graph_consts) in zip(*launched):
        assert eager_consts == graph_consts, name
        assert eager_spec == graph_spec, name
