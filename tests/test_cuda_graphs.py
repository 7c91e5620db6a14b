"""Decode steps through CUDA graphs (worker/cuda_graphs.py) give the same tokens as eager steps.

On CPU nothing is captured, but the graph path still runs (static buffers, batch-size buckets, padding
rows, the Triton backend's graph metadata, kernels in Triton's interpreter), so the bookkeeping is
checked here; on CUDA the same tests capture and replay real graphs."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams
from foveal.worker.cuda_graphs import DecodeGraphs, batch_buckets
from tests.test_loader import tiny_hf_tokenizer, tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_model("llama").save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def _llm(folder, **kw):
    from foveal.engine.llm import LLM

    opts = dict(
        device=DEVICE,
        dtype="float32",
        attention_backend="triton",
        num_blocks=64,
        block_size=4,
        max_num_seqs=6,
        max_model_len=64,
    )
    return LLM(str(folder), **{**opts, **kw})


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 9, 14)]


def test_graph_decode_matches_eager(tiny_folder):
    eager = _llm(tiny_folder, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 8)]
    want = [o.outputs[0].token_ids for o in eager.generate(_prompts(), params)]

    graphed = _llm(tiny_folder)
    runner = graphed.engine.runner
    if DEVICE == "cpu":  # the engine captures only on CUDA: run the graph path emulated
        runner.graphs = DecodeGraphs(
            graphed.engine.model,
            runner.kv_caches,
            runner.backend,
            block_size=4,
            max_seqs=6,
            max_model_len=64,
            device="cpu",
        )
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a, **kw: calls.append(a[0].shape[0]) or run(*a, **kw)
    got = [o.outputs[0].token_ids for o in graphed.generate(_prompts(), params)]
    assert got == want
    # 3 rows run in bucket 4 (a padding row) until the shortest finishes, then 2 rows, then 1
    assert sorted(set(calls)) == [1, 2, 3]
    graphed.engine.kv.check_integrity()
    assert graphed.engine.kv.num_used_blocks == 0


def test_graph_logits_match_the_torch_backend(tiny_folder):
    """One graphed decode step's logits equal the torch backend's eager logits for the same batch."""
    from foveal.engine.llm import LLM

    ref = LLM(str(tiny_folder), device=DEVICE, dtype="float32", attention_backend="torch", num_blocks=64,
              block_size=4, max_num_seqs=6, max_model_len=64, enforce_eager=True,
              async_scheduling=False)  # fmt: skip
    graphed = _llm(tiny_folder, async_scheduling=False)  # the test drives the steps itself
    runner = graphed.engine.runner
    if DEVICE == "cpu":
        runner.graphs = DecodeGraphs(graphed.engine.model, runner.kv_caches, runner.backend, block_size=4,
                                     max_seqs=6, max_model_len=64, device="cpu")  # fmt: skip
    logits = {}
    for name, llm in (("torch", ref), ("graph", graphed)):
        eng = llm.engine
        for p in _prompts():
            params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
            eng.add_request(llm.processor.request(p, params))
        eng.step()  # prefill of all three
        batch = eng.scheduler.schedule()  # the decode step
        assert all(s.num_tokens == 1 for s in batch.items)
        logits[name] = eng.runner.compute_logits(batch).float().cpu()
    torch.testing.assert_close(logits["graph"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures only on CUDA")
def test_graphs_own_their_split_workspace(tiny_folder):
    """Small decode buckets split the keys over programs that write partials into a workspace the
    warm-up before each capture makes; the graph replays into that memory, so the graphs must keep it.
    After the allocator hands its cached memory back and new tensors take it, graphed decoding still
    equals eager and leaves those tensors untouched (before the fix the workspace was freed after
    capture: the full-size W4 run faulted in a replay on the H200)."""
    kw = dict(max_model_len=1024, num_blocks=1024)
    eager = _llm(tiny_folder, enforce_eager=True, **kw)
    graphed = _llm(tiny_folder, **kw)
    graphs = graphed.engine.runner.graphs
    assert graphs.captured_meta[1].workspace is not None  # bucket 1 splits its keys: 1024 > 128
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    junk = [torch.full((1 << 18,), 7.0, device="cuda") for _ in range(256)]  # takes the freed memory
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 5, 8)]
    want = [o.outputs[0].token_ids for o in eager.generate(_prompts(), params)]
    got = [o.outputs[0].token_ids for o in graphed.generate(_prompts(), params)]
    assert got == want
    torch.cuda.synchronize()
    assert all(bool((j == 7.0).all()) for j in junk)
