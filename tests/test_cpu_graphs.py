"""Recorded decode steps on CPUs (worker/cpu_graphs.py) give exactly the tokens and log-probs of eager
steps: every bucket a batch passes through is recorded by its first step and replayed after, padding
rows included; an op a replay cannot follow leaves its bucket eager."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams
from foveal.worker import cpu_graphs
from tests.test_loader import tiny_hf_tokenizer, tiny_model

pytestmark = pytest.mark.skipif(
    __import__("foveal.attention.cpu_native", fromlist=["kernel"]).kernel() is None,
    reason="no C compiler: no native decode kernel, no recorded steps",
)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_model(request.param).save_pretrained(folder)
    tiny_hf_tokenizer().save_pretrained(folder)
    return folder


def _llm(folder, **kw):
    from foveal.engine.llm import LLM

    opts = dict(device="cpu", num_blocks=64, block_size=4, max_num_seqs=6, max_model_len=64)
    return LLM(str(folder), **{**opts, **kw})


def _run(llm, max_tokens=(12, 10, 8, 8, 5, 5)):
    """Greedy tokens and log-probs of len(max_tokens) prompts. The default lengths finish requests in
    groups so the batch goes 6 -> 4 -> 2 -> 1 rows: bucket sizes, no padding rows (a dense GEMM of a
    padded batch may round a row differently)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (3, 9, 14, 5, 7, 11)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in max_tokens]
    outs = [o.outputs[0] for o in llm.generate(prompts[: len(params)], params)]
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0
    return [o.token_ids for o in outs], [[(t.logprob, t.top) for t in o.logprobs] for o in outs]


def _counting_replays(llm, max_tokens=(12, 10, 8, 8, 5, 5)):
    replays = []
    replay = cpu_graphs.replay
    try:
        cpu_graphs.replay = lambda tape: replays.append(len(tape)) or replay(tape)
        return _run(llm, max_tokens), replays
    finally:
        cpu_graphs.replay = replay


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_recorded_decode_steps_equal_eager(tiny_folder, dtype):
    eager = _llm(tiny_folder, dtype=dtype, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    want = _run(eager)

    recorded = _llm(tiny_folder, dtype=dtype)
    graphs = recorded.engine.runner.graphs
    assert isinstance(graphs, cpu_graphs.CpuDecodeGraphs)
    got, replays = _counting_replays(recorded)
    assert got == want  # bit for bit: tokens and log-probs
    # every bucket the batch passed through recorded by its first step, replayed by the others
    assert set(graphs.tapes) == {1, 2, 4, 6} and all(graphs.tapes.values())
    # 11 decode steps (the longest request's 12 tokens; its prefill sampled the first), 4 recorded
    assert len(replays) == 11 - 4


def test_replays_allocate_nothing(tiny_folder):
    """A replay redoes only the step's compute: no tape entry it runs is an allocation (the graphs'
    logits buffer, made by the first recorded step with new_empty, was replayed every step until
    session 19: 12 MiB allocated and copied per step, ~0.8 ms of a 10 ms single-stream step)."""
    llm = _llm(tiny_folder, dtype="float32")
    _run(llm)
    tapes = [t for t in llm.engine.runner.graphs.tapes.values() if t]
    assert tapes
    for tape in tapes:
        replayed = [str(fn) for fn, _, kwargs, _ in tape if fn is not None and kwargs is not None]
        assert replayed and not [f for f in replayed if "empty" in f or "zeros" in f], replayed


def test_padding_rows(tiny_folder):
    """5 rows run in bucket 6 and 3 in bucket 4: the padding rows attend to nothing and write only the
    null block, so the real rows keep their tokens (log-probs up to GEMM rounding)."""
    lengths = (12, 9, 6, 4, 2)
    want_tokens, want_lp = _run(_llm(tiny_folder, dtype="float32", enforce_eager=True), lengths)
    recorded = _llm(tiny_folder, dtype="float32")
    (tokens, lp), replays = _counting_replays(recorded, lengths)
    assert tokens == want_tokens
    flat = [x for seq in lp for x, _ in seq]
    assert flat == pytest.approx([x for seq in want_lp for x, _ in seq], abs=1e-4)
    assert 6 in recorded.engine.runner.graphs.tapes and replays


def test_unrecordable_bucket_runs_eagerly(tiny_folder, monkeypatch):
    want = _run(_llm(tiny_folder, dtype="float32", enforce_eager=True))
    llm = _llm(tiny_folder, dtype="float32")
    model = llm.engine.model
    forward = model.forward

    def peeking(input_ids, *a, **kw):
        input_ids.sum().item()  # a value read back by Python: no tape can replay that
        return forward(input_ids, *a, **kw)

    monkeypatch.setattr(model, "forward", peeking)
    assert _run(llm) == want
    tapes = llm.engine.runner.graphs.tapes
    assert set(tapes) == {1, 2, 4, 6} and not any(tapes.values())


def test_keep_holds_tensors_only_while_recording():
    """native.keep puts tensors made before the recording (scratch a later call may replace) on the tape,
    so they outlive the replacement; outside a recording it does nothing."""
    from foveal import native

    tape: list = []
    native.recording.tape = tape
    try:
        scratch = torch.zeros(8)
        native.keep(scratch)
    finally:
        native.recording.tape = None
    assert tape == [(None, (scratch,), None, None)]
    native.keep(torch.zeros(1))  # not recording: nothing kept, nothing raised


def test_tapes_stop_at_their_memory_budget(tiny_folder, monkeypatch):
    want = _run(_llm(tiny_folder, dtype="float32", enforce_eager=True))
    llm = _llm(tiny_folder, dtype="float32")
    graphs = llm.engine.runner.graphs
    monkeypatch.setattr(cpu_graphs, "MAX_BYTES", 1)  # no tape fits: every bucket stays eager
    assert _run(llm) == want
    assert set(graphs.tapes) == {1, 2, 4, 6} and not any(graphs.tapes.values()) and graphs.nbytes == 0


def test_a_step_that_fails_to_record_runs_eagerly(tiny_folder, monkeypatch):
    """Any error while recording (not only an op the recorder knows it cannot follow) costs the bucket
    its replays, never the batch: the step runs again eagerly and the tokens are the eager ones."""
    from foveal import native

    want = _run(_llm(tiny_folder, dtype="float32", enforce_eager=True))
    llm = _llm(tiny_folder, dtype="float32")
    model = llm.engine.model
    forward = model.forward

    def fragile(*a, **kw):
        if native.recording.tape is not None:
            raise NotImplementedError("Cannot access storage of OpaqueTensorImpl")
        return forward(*a, **kw)

    monkeypatch.setattr(model, "forward", fragile)
    assert _run(llm) == want
    tapes = llm.engine.runner.graphs.tapes
    assert set(tapes) == {1, 2, 4, 6} and not any(tapes.values())


def test_first_use_packing_inside_a_recording_stays_off_the_tape(monkeypatch):
    """A weight's first 4-row GEMM inside a recorded step makes its oneDNN-packed copy there (the LM
    head's first 4-row call is a decode step's): the copy is the weight's, made unrecorded, and the
    tape replays the GEMM alone. onednn_packing's first check inside a recording still says yes."""
    from foveal import native
    from foveal.layers import linear as lin

    if not lin.onednn_packing():
        pytest.skip("this PyTorch cannot prepack for oneDNN")
    lin.onednn_packing.cache_clear()
    w, x = torch.randn(48, 32), torch.randn(4, 32)
    tape: list = []
    native.recording.tape = tape
    try:
        with cpu_graphs._Recorder(tape):
            out = lin.linear(x, w)
    finally:
        native.recording.tape = None
    assert lin.onednn_packing()  # not cached as False by the recording
    assert w._foveal_fp32[1].is_mkldnn
    ops = [str(fn) for fn, *_ in tape if fn is not None]
    assert not any("reorder" in op or "randn" in op for op in ops), ops
    assert cpu_graphs._made_bytes(tape) > 0
    expect = out.clone()
    out.zero_()
    cpu_graphs.replay(tape)
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(expect, x @ w.t())
