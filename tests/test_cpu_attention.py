"""The cpu attention backend (torch backend + the native paged-attention kernel,
foveal/attention/cpu_attention.c) against the torch backend on the paged cases of
tests/attention_cases.py: decode rows over every shape (GQA groups 1-7, head_dim 48, block sizes 4 and
16), few rows (tasks split by kv heads) and many (whole sequences), fp32/bf16/fp16, long contexts
(several key chunks), sliding windows, softcap, sinks, mixed steps whose prompt chunks run in the
kernel too (but for bidirectional spans); a row's output the same however its prompt was cut, batched
or ordered (bitwise); the fallbacks (quantized pools, no compiler).
"""

from __future__ import annotations

import pytest
import torch

from foveal.attention import cpu_native, get_backend
from foveal.attention.base import AttentionBatch
from foveal.attention.cpu_backend import CpuAttentionBackend
from foveal.attention.kv_quant import QuantizedKVCache
from foveal.attention.torch_backend import TorchAttentionBackend
from tests.attention_cases import DECODES, MIXED, SCALE, SHAPES, Case, compare

# alone: the kernels' OpenMP paths on torch's threads (`make test` runs the rest on one thread a worker)
pytestmark = pytest.mark.alone

CPU = torch.device("cpu")
kernel = cpu_native.kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler: the cpu backend is the torch one")


def cpu_case(seqs, **kw):
    return Case(seqs, device=CPU, **kw)


def native_calls(backend: CpuAttentionBackend, monkeypatch) -> list:
    calls = []
    real = backend.kernel.attend

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return real(*a, **kw)

    monkeypatch.setattr(backend.kernel, "attend", counted)
    return calls


@needs_kernel
@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)
def test_decode_matches_torch(num_kv, group, head_dim, bs, dtype, monkeypatch):
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    # 4 rows: tasks split by kv heads; 12 rows: one task per sequence; 300 keys: several chunks
    for seqs in (DECODES, DECODES * 2 + [(300, 1)] * 4):
        compare(cpu_case(seqs, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs, dtype=dtype), backend)
    assert calls == [4, 12]


@needs_kernel
@pytest.mark.parametrize("head_dim", [36, 64, 128, 192])
def test_head_dims_of_each_kernel_path(head_dim, monkeypatch):
    """36: plain loops; 64 / 128 / 192: four-key dot products and P V in 64-wide register slices
    (one, two, three per head); SmolLM2 and most models run 64 or 128."""
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    seqs = DECODES * 2 + [(300, 1)] * 3 + [(5, 1)]  # key counts that are and are not multiples of 4
    for dtype in (torch.float32, torch.bfloat16):
        compare(cpu_case(seqs, num_kv=3, group=3, head_dim=head_dim, bs=16, dtype=dtype, seed=3), backend)
    assert calls == [len(seqs)] * 2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mixed_decode_and_prefill(dtype, monkeypatch):
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    compare(cpu_case(MIXED + [(0, 30)], group=4, dtype=dtype, seed=1), backend)
    assert calls == [2 + 13 + 6 + 2 + 30]  # every row: the decode rows and the prompt chunks'


@needs_kernel
def test_bidirectional_spans_leave_the_prompt_chunks_to_the_torch_path(monkeypatch):
    """An image's tokens that see each other both ways (Gemma 3): masks the kernel has no notion of."""
    case = cpu_case(MIXED, group=2, seed=4)
    case.batch.bidirectional = [[], [], [(2, 9)], [(18, 24)], []]
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    compare(case, backend)
    assert calls == [2]  # the decode rows


@needs_kernel
@pytest.mark.parametrize("window", [1, 5, 16, 200])
def test_sliding_window(window, monkeypatch):
    case = cpu_case(
        DECODES[1:] + [(180, 1), (0, 20), (30, 9)], num_kv=1, group=4, head_dim=48, bs=4, seed=window
    )
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    compare(case, backend, window=window)
    assert calls == [4 + 20 + 9]


@needs_kernel
def test_softcap_with_and_without_window(monkeypatch):
    case = cpu_case([(90, 1)] * 3 + MIXED, group=4, num_kv=1, seed=3)  # 5 decode rows, then prefills
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    compare(case, backend, softcap=2.0)
    compare(case, backend, softcap=2.0, window=7)
    assert calls == [5 + 13 + 6 + 2] * 2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_sinks_with_and_without_window(dtype, monkeypatch):
    """gpt-oss's per-head sinks in the native kernel, decode rows and prompt rows."""
    case = cpu_case([(90, 1), (3, 1), (40, 1)] + MIXED, group=4, num_kv=2, dtype=dtype, seed=5)
    sinks = torch.linspace(-3.0, 6.0, 8).to(dtype)  # some heads weigh the sink more than any key
    backend = CpuAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    compare(case, backend, sinks=sinks)
    compare(case, backend, sinks=sinks, window=7)
    assert calls == [5 + 13 + 6 + 2] * 2


@needs_kernel
def test_layers_share_the_step_plan(monkeypatch):
    """One plan per step, many layers (windowed and not): each layer equals its own torch run."""
    case = cpu_case([(40, 1), (9, 1), (0, 5)], group=2, seed=8)
    backend, ref = CpuAttentionBackend(), TorchAttentionBackend()
    calls = native_calls(backend, monkeypatch)
    meta, meta_ref = backend.plan(case.batch, CPU), ref.plan(case.batch, CPU)
    for window in (None, 6, None, 3):
        c, c_ref = case.cache.clone(), case.cache.clone()
        out = backend.forward(case.q, case.k, case.v, c, meta, SCALE, window=window)
        want = ref.forward(case.q, case.k, case.v, c_ref, meta_ref, SCALE, window=window)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    assert calls == [7] * 4


def test_quantized_cache_takes_the_torch_path():
    case = cpu_case([(7, 1), (30, 1), (0, 9)], num_kv=2, group=2, head_dim=32, bs=4, seed=6)
    outs = []
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        pool = QuantizedKVCache("int8", case.cache.shape[1], 2, 32, device=CPU)
        outs.append(backend.forward(case.q, case.k, case.v, pool, backend.plan(case.batch, CPU), SCALE))
    assert torch.equal(outs[0], outs[1])


def test_auto_backend_on_cpu():
    assert get_backend("auto", CPU).name == ("torch" if kernel is None else "cpu")
    assert get_backend("cpu", CPU).name == "cpu"


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    """A machine without a working C compiler gets the torch path, not an error."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FOVEAL_CACHE_DIR", str(tmp_path))
    cpu_native.kernel.cache_clear()
    try:
        assert cpu_native.kernel() is None
        assert get_backend("auto", CPU).name == "torch"
        backend = CpuAttentionBackend()  # asked for by name: runs, on the torch path
        compare(cpu_case(DECODES, seed=2), backend)
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        cpu_native.kernel.cache_clear()


@needs_kernel
def test_built_once_per_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FOVEAL_CACHE_DIR", str(tmp_path))
    cpu_native.kernel.cache_clear()
    try:
        assert cpu_native.kernel() is not None
        (built,) = tmp_path.glob("kernels/cpu_attention-*.so")
        stamp = built.stat().st_mtime_ns
        cpu_native.kernel.cache_clear()
        assert cpu_native.kernel() is not None
        assert built.stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        cpu_native.kernel.cache_clear()


@needs_kernel
def test_nan_key_poisons_its_rows_as_in_sdpa():
    """A NaN in the cache reaches the output (not masked into a plausible number by the kernel's exp)."""
    case = cpu_case([(20, 1), (20, 1)], num_kv=2, group=2, seed=9)
    table = case.batch.block_tables[0]
    case.cache[0, table[0] * 16 + 3, 1] = float("nan")  # sequence 0, position 3, kv head 1
    native = CpuAttentionBackend()
    assert native.plan(case.batch, CPU).extra is not None  # the decode rows take the kernel
    outs = [case.run(b, case.cache.clone()) for b in (TorchAttentionBackend(), native)]
    for out in outs:
        assert out[0, 2:].isnan().all() and not out[0, :2].isnan().any() and not out[1].isnan().any()
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-5, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kv_store_writes_what_index_copy_writes(dtype):
    """The native K/V store against index_copy_: k and v as the decoder hands them over (views of a
    fused q/k/v projection: rows further apart than their own size), any slot order; nothing else
    in the pool changes."""
    g = torch.Generator().manual_seed(0)
    slots_n, kvh, d, t = 64, 3, 16, 5
    qkv = torch.randn(t, (6 + 2 * kvh) * d, generator=g).to(dtype)
    k = qkv[:, 6 * d : (6 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (6 + kvh) * d :].view(t, kvh, d)
    slots = torch.tensor([40, 3, 17, 63, 0])
    pools = [torch.randn(2, slots_n, kvh, d, generator=g).to(dtype) for _ in range(2)]
    want, got = pools[0], pools[1].copy_(pools[0])
    want[0].index_copy_(0, slots, k)
    want[1].index_copy_(0, slots, v)
    assert kernel.store(got[0], got[1], slots, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a layout it does not take (a pool of another dtype) is left to the caller, untouched
    other = torch.zeros(slots_n, kvh, d, dtype=torch.float16)
    assert not kernel.store(other, other, slots, k, v) and not other.any()


def _steps(plan: list[list[tuple[int, int, int]]], n: int, others: int, shape, dtype, window):
    """Run the steps of `plan` (each a list of (sequence, first position, tokens)) through the cpu
    backend over one paged pool: sequence 0 has n tokens, sequence 1 `others`; every token's q/k/v is
    fixed in advance. Returns {(sequence, position): its output row}."""
    num_kv, group, head_dim, bs = shape
    g = torch.Generator().manual_seed(11)
    lengths = (n, others)
    blocks = [-(-x // bs) for x in lengths]
    order = (torch.randperm(sum(blocks) + 2, generator=g)[: sum(blocks)] + 1).tolist()
    tables = [order[: blocks[0]], order[blocks[0] :]]
    pool = (torch.randn(2, (sum(blocks) + 3) * bs, num_kv, head_dim, generator=g) * 10).to(dtype)
    qkv = [torch.randn(x, num_kv * (group + 2), head_dim, generator=g).to(dtype) for x in lengths]
    backend, got = CpuAttentionBackend(), {}
    for step in plan:
        rows = [(s, p) for s, p0, m in step for p in range(p0, p0 + m)]
        x = torch.stack([qkv[s][p] for s, p in rows])
        q, k, v = x.split([num_kv * group, num_kv, num_kv], dim=1)
        slots = [tables[s][p // bs] * bs + p % bs for s, p in rows]
        batch = AttentionBatch(
            query_lens=[m for _, _, m in step],
            context_lens=[p0 for _, p0, _ in step],
            block_tables=[tables[s] for s, _, _ in step],
            num_decodes=next((i for i, (_, _, m) in enumerate(step) if m != 1), len(step)),
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_size=bs,
        )
        out = backend.forward(q, k, v, pool, backend.plan(batch, CPU), SCALE, window=window)
        got.update({row: out[i] for i, row in enumerate(rows)})
    return got


@needs_kernel
@pytest.mark.parametrize("shape", [(3, 3, 64, 16), (2, 4, 128, 4)], ids=["smollm2", "d128-bs4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 37])
def test_a_tokens_output_does_not_depend_on_how_its_prompt_was_cut(shape, dtype, window):
    """The same token's attention output, bit for bit, whether its prompt of 150 tokens ran whole, in
    chunks (a prefix hit's remainder is one), beside another sequence's rows before or after it, or
    token by token as decode rows: each row has its own keys over a fixed grid of key chunks."""
    n, m = 150, 70
    ways = {
        "whole": [[(0, 0, n)]],
        "chunks": [[(0, 0, 13)], [(0, 13, 51)], [(0, 64, 1)], [(0, 65, n - 65)]],
        "batched after": [[(1, 0, m)], [(1, m - 1, 1), (0, 0, 100), (1, 0, 0)], [(0, 100, n - 100)]],
        "batched before": [[(0, 0, 100), (1, 0, m)], [(0, 100, n - 100), (1, 0, 0)]],
        "token by token": [[(0, 0, 20)]] + [[(0, p, 1)] for p in range(20, n)],
    }
    outs = {name: _steps([[x for x in s if x[2]] for s in plan], n, m, shape, dtype, window)
            for name, plan in ways.items()}  # fmt: skip
    want = torch.stack([outs["whole"][(0, p)] for p in range(n)])
    for name, got in outs.items():
        assert torch.equal(torch.stack([got[(0, p)] for p in range(n)]), want), name
