"""Shared-prefix decode (foveal/attention/kernels/shared_prefix.py): the grouping plan, and the Triton
backend with groups against the torch backend (the oracle) and against itself without them: mixed
groups and lone rows, ragged suffixes, more rows than a tile, rows sharing less than their group,
prefixes that end mid-block, GQA shapes, several key splits, softcap, sinks, bf16, windows (which
take the plain path). On CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foveal.attention.kernels.shared_prefix import ROWS_PER_TILE, plan_groups
from foveal.attention.triton_backend import TritonAttentionBackend
from tests.attention_cases import DEVICE, SHAPES, Case, tolerance
from tests.attention_cases import compare as compare_strict


def compare(case: Case, backend, **kw) -> torch.Tensor:
    """attention_cases.compare at float32 tolerances for rows of up to ~100 keys of values ~N(0, 1):
    the plain Triton path is ~4e-5 from the float64 result on these cases as well, the oracle ~2e-5.
    Returns the backend's output there (case.run on a clone of the cache: a test comparing it with
    another path needs no second run)."""
    fp32 = case.q.dtype == torch.float32
    outs = []
    forward = backend.forward
    backend.forward = lambda *a, **k: outs.append(forward(*a, **k)) or outs[-1]
    try:
        compare_strict(case, backend, tol=dict(atol=1e-4, rtol=1e-4) if fp32 else None, **kw)
    finally:
        del backend.forward  # the class's again
    assert len(outs) == 1
    return outs[0]


def test_plan_groups_rows_by_first_block_and_their_common_run():
    bs = 4
    lead = [10, 11, 12, 13, 14]
    tables = [
        lead + [20],  # 0: group A's leader (its last key stays its own)
        lead[:4] + [21, 22],  # 1: shares 4 blocks
        lead[:2] + [23, 24, 25],  # 2: shares 2 blocks
        [30, 31, 32],  # 3: alone
        lead + [26],  # 4: shares 5
        [30, 33],  # 5: shares block 30 with row 3 only: a group of 2
        lead[:3],  # 6: its whole table is shared, its context ends inside block 12 -> mid-block
    ]
    seq_lens = [23, 22, 20, 12, 24, 8, 10]
    arr = np.zeros((len(tables), 6), dtype=np.int32)
    for i, t in enumerate(tables):
        arr[i, : len(t)] = t
    lens = np.array([len(t) for t in tables])
    prefix, rows, tiles = plan_groups(arr, lens, np.array(seq_lens), bs, min_rows=3, min_prefix=6)
    assert prefix.tolist() == [20, 16, 8, 0, 20, 0, 9]  # row 6: 9 = its seq_len - 1
    assert rows.tolist() == [0, 4, 1, 6, 2]  # group A, longest first (ties in row order)
    assert tiles.tolist() == [[0, 5, 20, 0]]
    # below min_prefix a row drops out; below min_rows its group does
    prefix, _, _ = plan_groups(arr, lens, np.array(seq_lens), bs, min_rows=3, min_prefix=10)
    assert prefix.tolist() == [20, 16, 0, 0, 20, 0, 0]
    prefix, rows, tiles = plan_groups(arr, lens, np.array(seq_lens), bs, min_rows=4, min_prefix=10)
    assert not prefix.any() and not len(rows) and not len(tiles)


def test_plan_groups_a_requests_own_rows():
    """Neighbouring rows with one table (a request's verify or block rows) group on their own when >= 2
    of them hold >= min_request_prefix keys, each to its own last key; rows in a first-block group that
    meets min_rows stay there; a neighbour that only looks alike (first and last block) shares what it
    holds."""
    bs = 4
    a, b, c = [10, 11, 12], [20, 21, 22, 23], [30, 31]
    tables = [a, a, a, b, b, [20, 24, 25, 23], [40, 41], a, c, [30, 32]]
    seq_lens = [9, 10, 11, 14, 16, 15, 8, 12, 6, 7]
    arr = np.zeros((len(tables), 4), dtype=np.int32)
    for i, t in enumerate(tables):
        arr[i, : len(t)] = t
    lens = np.array([len(t) for t in tables])
    prefix, rows, tiles = plan_groups(arr, lens, np.array(seq_lens), bs, 0, 1, min_request_prefix=8)
    # rows 0-2: a run (row 7 holds table a too, but apart from them: alone); 3-4: a run, and 5 looks
    # like them but holds one block of theirs (4 keys: below the bar); 8-9 end in other blocks: no run
    assert prefix.tolist() == [8, 9, 10, 13, 15, 0, 0, 0, 0, 0]
    assert rows.tolist() == [2, 1, 0, 4, 3]  # by group, longest first
    assert tiles.tolist() == [[0, 3, 10, 0], [3, 2, 15, 3]]
    prefix, rows, tiles = plan_groups(arr, lens, np.array(seq_lens), bs, 0, 1, min_request_prefix=4)
    assert prefix.tolist() == [8, 9, 10, 13, 15, 4, 0, 0, 0, 0]  # 4 keys now make the bar
    assert not plan_groups(arr, lens, np.array(seq_lens), bs, 0, 1, min_request_prefix=0)[1].size
    # a step with fewer than min_request_groups such requests: none (2 here)
    assert plan_groups(arr, lens, np.array(seq_lens), bs, 0, 1, 8, min_request_groups=2)[1].size == 5
    assert not plan_groups(arr, lens, np.array(seq_lens), bs, 0, 1, 8, min_request_groups=3)[1].size
    # a first-block group that meets min_rows takes its rows first; the runs form among the others
    prefix, rows, tiles = plan_groups(arr, lens, np.array(seq_lens), bs, 4, 4, min_request_prefix=8)
    assert prefix.tolist() == [8, 9, 10, 13, 15, 0, 0, 11, 0, 0]  # a's four rows: one group
    assert tiles.tolist() == [[0, 4, 11, 0], [4, 2, 15, 3]]


def shared_case(seqs, groups, **kw) -> Case:
    """Case(seqs) whose rows in each group (rows, blocks) hold their group's first row's first `blocks`
    blocks (the prefix cache's sharing); a row's new token stays in a block of its own."""
    case = Case(seqs, **kw)
    tables = case.batch.block_tables
    for members, blocks in groups:
        lead = tables[members[0]]
        for i in members[1:]:
            n = min(blocks, len(tables[i]) - 1, len(lead))
            tables[i][:n] = lead[:n]
    return case


# 21 decode rows: group A (rows 0-17: > one tile, ragged suffixes, row 5 sharing less), group B (18-20)
SEQS = [(40 + 3 * i, 1) for i in range(18)] + [(30, 1), (31, 1), (45, 1), (9, 1), (60, 1)]
GROUPS = [(list(range(5)) + list(range(6, 18)), 9), ([0, 5], 4), ([18, 19, 20], 7)]


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_shared_prefixes_equal_the_oracle_and_the_plain_path(num_kv, group, head_dim, bs):
    case = shared_case(SEQS, GROUPS, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs, seed=group)
    shared = TritonAttentionBackend(shared_min_rows=3, shared_min_prefix=4)
    meta = shared.plan(case.batch, case.device)
    assert meta.shared is not None and meta.shared.num_tiles >= 3  # A in two tiles and B
    assert ROWS_PER_TILE < 18
    out = compare(case, shared)
    plain = case.run(TritonAttentionBackend(shared_min_rows=0), case.cache.clone())
    torch.testing.assert_close(out, plain, **tolerance(case.q.dtype, 2))
    assert meta.shared.prefix_lens.count_nonzero().item() == 21  # every row of both groups


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_shared_prefixes_with_splits_softcap_and_sinks(dtype):
    case = shared_case(SEQS, GROUPS, num_kv=2, group=4, head_dim=32, bs=4, dtype=dtype, seed=5)
    backend = TritonAttentionBackend(split_tokens=8, shared_min_rows=3, shared_min_prefix=4)
    compare(case, backend)
    compare(case, backend, softcap=2.0)
    sinks = torch.linspace(-3.0, 6.0, 8, device=case.device).to(dtype)
    compare(case, backend, sinks=sinks)
    compare(case, backend, window=7)  # windowed layers: the plain path


def test_a_mixed_step_with_prefill_rows_after_the_shared_decodes():
    seqs = SEQS[:6] + [(0, 13), (21, 6)]
    case = shared_case(seqs, [(list(range(6)), 9)], num_kv=1, group=4, head_dim=48, bs=4, seed=2)
    backend = TritonAttentionBackend(shared_min_rows=4, shared_min_prefix=8)
    assert backend.plan(case.batch, case.device).shared is not None
    compare(case, backend)


def request_case(seqs, runs, slots=None, **kw) -> Case:
    """Case(seqs) whose rows in each run hold one table (the run's last row's, the same list, as a
    step's rows of one request do); `slots[i]`: row i's key position where it is not its context (a
    DFlash or block diffusion block row)."""
    case = Case(seqs, **kw)
    b, bs = case.batch, case.batch.block_size
    for run in runs:
        for i in run[:-1]:
            b.block_tables[i] = b.block_tables[run[-1]]
    where = [(slots or {}).get(i, c) for i, c in enumerate(b.context_lens)]
    b.slot_mapping = torch.tensor(
        [t[p // bs] * bs + p % bs for t, p in zip(b.block_tables, where)], device=case.device
    )
    return case


# a request's verify rows (0-3), a DFlash-like request: two catch-up rows and a block of five rows
# seeing the whole block (4-10), a short request's verify rows (11-12: below the bar), lone rows
VERIFY_SEQS = [(37 + i, 1) for i in range(4)] + [(28, 1), (29, 1)] + [(34, 1)] * 5 + [(5, 1), (6, 1), (50, 1)]
VERIFY_RUNS = [[0, 1, 2, 3], list(range(4, 11)), [11, 12]]
BLOCK_SLOTS = {6 + j: 30 + j for j in range(5)}  # the block rows' keys at positions 30-34


@pytest.mark.parametrize("num_kv,group,head_dim,bs", SHAPES)
def test_a_requests_own_rows_equal_the_oracle_and_the_plain_path(num_kv, group, head_dim, bs):
    case = request_case(
        VERIFY_SEQS, VERIFY_RUNS, BLOCK_SLOTS, num_kv=num_kv, group=group, head_dim=head_dim, bs=bs, seed=3
    )
    backend = TritonAttentionBackend(shared_min_rows=0, request_min_prefix=8, request_min_groups=2)
    meta = backend.plan(case.batch, case.device)
    assert meta.shared.num_tiles == 2 and meta.shared.prefix_lens.count_nonzero().item() == 11
    backend.request_min_groups = 3  # a step with fewer such requests keeps the plain path
    assert backend.plan(case.batch, case.device).shared is None
    backend.request_min_groups = 2  # (the grouped path is the one compared below)
    out = compare(case, backend)
    plain = case.run(TritonAttentionBackend(shared_min_rows=0), case.cache.clone())
    torch.testing.assert_close(out, plain, **tolerance(case.q.dtype, 2))


def _graph_run(backend, case, static, padded: int):
    """The case through graph metadata of `padded` rows with the shared-prefix kernel (junk q/k/v in the
    padding rows, as a padded graph batch has): (the metadata, the batch's rows of the output)."""
    n = len(case.batch.query_lens)
    meta = backend.fill_graph_metadata(static, case.batch, padded, shared=True)
    q, k, v = (
        torch.cat([x, torch.randn_like(x[:1]).expand(padded - n, -1, -1)]) for x in (case.q, case.k, case.v)
    )
    out = backend.forward(q, k, v, case.cache.clone(), meta, 0.3)
    assert torch.isfinite(out[n:]).all()
    return meta, out[:n]


def test_graph_metadata_with_shared_prefixes_equals_the_oracle():
    """A graph's shared-prefix metadata (one tile program per row of the bucket, unused ones empty):
    a grouped batch and then a batch with no groups through the same static buffers, each equal to the
    torch backend; the second fill leaves no stale groups behind."""
    from foveal.attention.torch_backend import TorchAttentionBackend

    backend = TritonAttentionBackend(shared_min_rows=3, shared_min_prefix=4)
    static = backend.graph_metadata(32, max_blocks_per_seq=64, block_size=4, device=DEVICE)
    n, padded = len(SEQS), len(SEQS) + 3
    for case, grouped in (
        (shared_case(SEQS, GROUPS, num_kv=1, group=4, head_dim=48, bs=4, seed=7), 21),
        (Case(SEQS, num_kv=1, group=4, head_dim=48, bs=4, seed=8), 0),
    ):
        meta, out = _graph_run(backend, case, static, padded)
        assert meta.shared.num_tiles == padded and int((meta.shared.prefix_lens[:n] > 0).sum()) == grouped
        want = case.run(TorchAttentionBackend(), case.cache.clone())
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
    # a request's own rows through the same static buffers
    backend.shared_min_rows, backend.request_min_prefix, backend.request_min_groups = 0, 8, 1
    case = request_case(VERIFY_SEQS, VERIFY_RUNS, BLOCK_SLOTS, num_kv=1, group=4, head_dim=48, bs=4, seed=9)
    meta, out = _graph_run(backend, case, static, len(VERIFY_SEQS) + 2)
    assert int((meta.shared.prefix_lens > 0).sum()) == 11
    want = case.run(TorchAttentionBackend(), case.cache.clone())
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_shares_prefixes_tells_the_runner_when_to_take_the_shared_graphs():
    backend = TritonAttentionBackend(shared_min_rows=3, shared_min_prefix=4)
    batch = shared_case(SEQS, GROUPS, bs=4).batch
    assert backend.shares_prefixes(batch)
    assert not backend.shares_prefixes(Case(SEQS, bs=4).batch)  # no block in common
    assert not TritonAttentionBackend(shared_min_rows=0).shares_prefixes(batch)


# -- through the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.tiny import tiny_llama_config_file

    return tiny_llama_config_file(tmp_path_factory.mktemp("cfg"))


BAR = dict(shared_prefix_min_rows=4, shared_prefix_min_tokens=8)
# every row drafts when it can (the adaptive policy rests on a CPU: no verify rows)
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=1, prompt_lookup_min=1)
NGRAM["adaptive"] = False


def _engine_tokens(folder, prompts, monkeypatch=None, graphs=False, bar=BAR, warm=40, **kw):
    """Greedy tokens of the prompts, all sent after one request with their common prefix (its first
    `warm` tokens: that puts the prefix's blocks in the cache); with monkeypatch, the Triton backend
    groups rows by `bar` (from 4 rows behind 8 keys; a request's own rows in steps of any size) and the
    shared-prefix launches are counted."""
    from foveal import SamplingParams
    from foveal.attention.kernels import decode
    from foveal.engine.llm import LLM
    from foveal.worker.cuda_graphs import DecodeGraphs

    opts = dict(dtype="float32", num_blocks=160, block_size=4, max_num_seqs=16, max_model_len=128)
    if monkeypatch is not None:  # the engine options reach the backend
        opts.update(bar)
        # eager steps call the kernel's Python function (CUDA's own graphs would replay it uncounted)
        opts["enforce_eager"] = not graphs
    llm = LLM(str(folder), load_format="dummy", enable_prefix_caching=True, **{**opts, **kw})
    launches = []
    if monkeypatch is not None:
        r = llm.engine.runner
        assert (r.backend.shared_min_rows, r.backend.shared_min_prefix) == (
            bar["shared_prefix_min_rows"],
            bar.get("shared_prefix_min_tokens", 1024),
        )
        r.backend.request_min_groups = 1  # (not an engine option: the plain path's splits win below it)
        real = decode.shared_prefix_attention
        monkeypatch.setattr(decode, "shared_prefix_attention", lambda *a: launches.append(1) or real(*a))
        if graphs:  # graphs captured after the bar came down (on a CPU the graph path is emulated)
            r.graphs = DecodeGraphs(llm.engine.model, r.kv_caches, r.backend, block_size=4, max_seqs=16,
                                    max_model_len=128, device=llm.engine.device)  # fmt: skip
            r.graphs.capture()
            assert r.graphs.shared_buckets == [4, 8, 16]  # from the bar, 4 rows, up
        if graphs:  # which replays took the shared-prefix variant
            replay = r.graphs.replay
            r.graphs.replay = lambda batch, n, lora=False, shared=False: (
                launches.append("graph") if shared else None,
                replay(batch, n, lora, shared),
            )[1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([prompts[0][:warm]], params)
    outs = llm.generate(prompts, params)
    llm.engine.kv.check_integrity()
    spec = llm.engine.speculation
    if spec is not None:  # verify rows ran (else a test of them proves nothing)
        assert spec.stats.num_drafts >= len(prompts)
    return [o.outputs[0].token_ids for o in outs], launches


_PLAIN: dict = {}


def _plain_tokens(folder, prompts, **kw):
    """_engine_tokens' plain greedy tokens (the torch backend, no grouping), made once a module for
    the tests that compare with the same ones."""
    key = (str(folder), repr(prompts), repr(sorted(kw.items())))
    if key not in _PLAIN:
        _PLAIN[key] = _engine_tokens(folder, prompts, **kw)[0]
    return _PLAIN[key]


def _shared_prompts(n=10):
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 250, (40,), generator=g).tolist()
    return [prefix + torch.randint(3, 250, (3 + i % 5,), generator=g).tolist() for i in range(n)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-path"])
def test_engine_greedy_with_shared_prefixes_equals_the_plain_path(folder, monkeypatch, graphs):
    """Ten requests behind a 40-token cached prefix: their decode steps group (the kernel runs; on the
    graph path through the graph variant with the shared-prefix kernel) and every
    token equals the torch backend's."""
    prompts = _shared_prompts()
    want = _plain_tokens(folder, prompts)
    got, launches = _engine_tokens(folder, prompts, monkeypatch, graphs=graphs, attention_backend="triton")
    assert launches and got == want
    assert ("graph" in launches) == graphs


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_engine_greedy_with_shared_prefixes_over_quantized_pools(folder, monkeypatch, kind):
    """fp8 / int8 KV pools: the Triton kernels read the codes (grouped rows included) and give the
    tokens of the CPU backend over the same quantized pool."""
    prompts = _shared_prompts(6)
    want, _ = _engine_tokens(folder, prompts, kv_cache_dtype=kind)
    got, launches = _engine_tokens(
        folder, prompts, monkeypatch, attention_backend="triton", kv_cache_dtype=kind
    )
    assert launches and got == want


def test_speculative_verify_rows_group_too(folder, monkeypatch):
    """n-gram speculation: a request's verify rows share all its blocks, so they group with each other
    and with the other requests' rows; tokens equal plain greedy's."""
    # the shared prefix holds every token id, so the last token always has an earlier occurrence: drafts
    perm = torch.randperm(253, generator=torch.Generator().manual_seed(0)).add(3).tolist()
    prompts = [perm + p[40:] for p in _shared_prompts(6)]
    # the whole common prefix cached first: the six rows read its 63 blocks from the cache (the
    # grouped prefix spans several of the kernel's key tiles) and prefill their suffixes alone, where
    # each would store its own 213 tokens of it
    big = dict(num_blocks=300, max_model_len=300, warm=len(perm))
    want, _ = _engine_tokens(folder, prompts, **big)
    got, launches = _engine_tokens(
        folder, prompts, monkeypatch, attention_backend="triton", speculative_config=NGRAM, **big
    )
    assert launches and got == want


def test_a_requests_verify_rows_group_on_their_own(folder, monkeypatch):
    """With no cross-request groups (min rows 0), a request's verify rows read its keys once for all of
    them from request_rows_min_tokens keys on; tokens equal plain greedy's. Without speculation the
    engine turns that grouping off (no request has several rows)."""
    # every token id is in each prompt, so the last token always has an earlier occurrence: drafts
    prompts = [
        torch.randperm(253, generator=torch.Generator().manual_seed(i)).add(3).tolist() for i in (1, 2)
    ]
    big = dict(num_blocks=300, max_model_len=300)
    want, _ = _engine_tokens(folder, prompts, **big)
    bar = dict(shared_prefix_min_rows=0, request_rows_min_tokens=8)
    got, launches = _engine_tokens(
        folder, prompts, monkeypatch, bar=bar, attention_backend="triton", speculative_config=NGRAM, **big
    )
    assert len(launches) >= 5 * 2 and got == want  # every decode step of both layers grouped
    from foveal.engine.llm import LLM

    plain = LLM(str(folder), load_format="dummy", attention_backend="triton", request_rows_min_tokens=8)
    assert plain.engine.runner.backend.request_min_prefix == 0


def test_the_engine_options_are_checked(folder):
    from foveal.engine.llm import LLM

    with pytest.raises(ValueError, match="shared_prefix_min_rows"):
        LLM(str(folder), load_format="dummy", shared_prefix_min_rows=-1)
    with pytest.raises(ValueError, match="request_rows_min_tokens"):
        LLM(str(folder), load_format="dummy", request_rows_min_tokens=-1)
