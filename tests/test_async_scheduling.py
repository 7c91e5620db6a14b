"""Async scheduling (step N+1 scheduled and launched before step N's tokens reach the host) gives the
same outputs as plain steps: greedy and seeded sampling, stop tokens and strings, min_tokens, length
limits, penalties (their sampling waits for the step in flight, the forward pass does not), logprobs,
preemption, prefix hits, aborts, the graph path. On CPU nothing actually overlaps, but the bookkeeping
(pending tokens, device-side inputs, late stops) is the same code."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams
from foveal.worker.cuda_graphs import DecodeGraphs


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama config with random weights and the synthetic tokenizer: every id decodes to text
    (" t<id>"), so stop strings can be taken from any output."""
    from tests.tiny import tiny_llama_config_file

    return tiny_llama_config_file(tmp_path_factory.mktemp("cfg"))


def _llm(folder, overlap: bool, **kw):
    from foveal.engine.llm import LLM

    opts = dict(dtype="float32", num_blocks=96, block_size=4, max_num_seqs=8, max_model_len=128)
    return LLM(str(folder), load_format="dummy", async_scheduling=overlap, **{**opts, **kw})


def _prompts(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 250, (int(k),), generator=g).tolist()
        for k in torch.randint(3, 30, (n,), generator=g)
    ]


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished()
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def _same(folder, prompts, params, check=None, **kw):
    """The outputs with async scheduling equal the ones without; `check(llm)` holds on both engines
    afterwards (that the run did what the test is about)."""
    llms = _llm(folder, False, **kw), _llm(folder, True, **kw)
    sync, over = (_run(llm, prompts, params) for llm in llms)
    assert over == sync
    if check is not None:
        assert all(check(llm.engine) for llm in llms)
    return sync


def test_greedy_with_mixed_lengths(folder):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 7, 12, 3, 20)]
    out = _same(folder, _prompts(), params)
    assert [len(t) for t, _, _ in out] == [1, 7, 12, 3, 20]


def test_seeded_sampling_and_min_tokens(folder):
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=10, min_tokens=4, ignore_eos=True)
        for i in range(5)
    ]
    _same(folder, _prompts(), params)


def test_stop_tokens_and_strings_stop_at_the_same_place(folder):
    """Stops are seen one step late with overlap: the extra token computed must not leak out."""
    base = _run(
        _llm(folder, False), _prompts(), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    params = []
    for i, (toks, _text, _) in enumerate(base):
        if i % 2 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=16, stop=[f" t{toks[6]}"]))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[toks[5]]))
    assert any(p.stop for p in params)
    out = _same(folder, _prompts(), params)
    assert all(reason == "stop" for _, _, reason in out)


def runner_calls(llm) -> list[str]:
    """Spy: the runner's launch, sample and collect calls, in order."""
    runner, calls = llm.engine.runner, []

    def spy(name: str):
        real = getattr(runner, name)

        def call(*args, **kw):
            calls.append(name)
            return real(*args, **kw)

        return call

    for name in ("launch", "sample", "collect"):
        setattr(runner, name, spy(name))
    return calls


def sampling_deferred(calls: list[str]) -> bool:
    """Whether some step's sampling waited for the step in flight: launched, that step collected (its
    tokens read on the host), then sampled."""
    return any(calls[i : i + 3] == ["launch", "collect", "sample"] for i in range(len(calls)))


def test_penalties_and_logprobs(folder):
    params = [
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, frequency_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, presence_penalty=0.5),
    ]
    sync = _run(_llm(folder, False), _prompts(), params)
    over_llm = _llm(folder, True)
    calls = runner_calls(over_llm)
    assert _run(over_llm, _prompts(), params) == sync
    # penalties count on the device (sample/history.py): no step's sampling waits for the one in flight
    assert calls.count("sample") > 5 and not sampling_deferred(calls)


def test_preemption_under_a_small_pool(folder):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    _same(folder, _prompts(8, seed=3), params, check=lambda e: e.scheduler.num_preemptions > 0, num_blocks=24)


def test_prefix_hits(folder):
    shared = _prompts(1, seed=5)[0] * 3
    prompts = [shared + p for p in _prompts(4, seed=6)] * 2
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    # at least one request found the shared prefix's whole blocks (of 4) in the cache
    _same(folder, prompts, params, check=lambda e: e.kv.hit_tokens >= len(shared) // 4 * 4)


def test_abort_while_a_step_is_in_flight(folder):
    llm = _llm(folder, True)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [eng.add_request(llm.processor.request(p, params)) for p in _prompts()]
    for _ in range(4):
        eng.step()
    assert eng._inflight is not None
    eng.abort(ids[1])
    eng.abort(ids[3])
    finals = {}
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                finals[d.request_id] = d
    assert {finals[ids[1]].finish_reason, finals[ids[3]].finish_reason} == {"abort"}
    assert sum(f.finish_reason == "length" for f in finals.values()) == 3
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0


def test_graph_path_with_overlap(folder):
    """Decode steps through the (emulated on CPU) CUDA-graph path, their inputs taken on the device from
    the step in flight."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 11, 8, 2, 9)]
    want = _run(_llm(folder, False), _prompts(), params)
    llm = _llm(folder, True, attention_backend="triton")
    r = llm.engine.runner
    if r.graphs is None:  # CPU: the engine does not capture; run the graph path emulated
        r.graphs = DecodeGraphs(llm.engine.model, r.kv_caches, r.backend, block_size=4, max_seqs=8,
                                max_model_len=128, device=llm.engine.device)  # fmt: skip
    got = _run(llm, _prompts(), params)
    assert [t for t, _, _ in got] == [t for t, _, _ in want]


def test_a_verify_steps_tokens_are_emitted_after_the_next_launch(folder):
    """While speculating each verify step runs alone (its proposals need its tokens): its tokens are
    applied when they arrive, but detokenized and emitted only once the next step is launched, so the
    device is not idle meanwhile. Outputs, stop strings and tokens included, equal the synchronous
    engine's, and a request aborted between the two keeps its one final delta."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
            "adaptive": False}  # fmt: skip
    prompts = [p * 3 for p in _prompts(5, seed=8)]  # repeated: the n-grams find drafts
    base = _run(_llm(folder, False, speculative_config=spec), prompts,
                SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=16, stop=[f" t{toks[7]}"])
        if i % 2
        else SamplingParams(temperature=0, max_tokens=16 - i, ignore_eos=True)
        for i, (toks, _, _) in enumerate(base)
    ]
    sync = _run(_llm(folder, False, speculative_config=spec), prompts, params)
    llm = _llm(folder, True, speculative_config=spec)
    calls = runner_calls(llm)
    eng, emit = llm.engine, llm.engine._emit
    eng._emit = lambda *a: calls.append("emit") or emit(*a)
    assert _run(llm, prompts, params) == sync
    assert eng.speculation.stats.num_drafts > 0
    assert any(reason == "stop" for _, _, reason in sync)
    # after each collect, the next step (where there is one) was launched before any token was emitted
    tail = [c for c in calls if c != "sample"]
    for i, c in enumerate(tail):
        if c == "collect" and "launch" in tail[i:]:
            assert next(x for x in tail[i + 1 :] if x in ("launch", "emit")) == "launch", tail[i : i + 4]
    # an abort between a verify step and the next launch: no delta after its final one
    ids = [
        eng.add_request(llm.processor.request(p, SamplingParams(temperature=0, max_tokens=30)))
        for p in prompts
    ]
    for _ in range(3):
        eng.step()
    assert eng._unemitted
    victim = eng._unemitted[0][0].req.request_id
    eng.abort(victim)
    seen = []
    while eng.has_unfinished():
        seen += [d for d in eng.step() if d.request_id == victim]
    assert len(seen) == 1 and seen[0].finish_reason == "abort"
    assert set(ids) >= {victim} and eng.kv.num_used_blocks == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_never_waits_for_the_device(folder):
    """Every sampling mix (temperature, top_k, top_p, min_p, the three penalties on the device
    history, seeds, logprobs, logit bias, min_tokens) is sampled without the host waiting for the
    forward pass: CUDA's sync debug mode raises at any synchronizing call inside the runner's sample()."""
    llm = _llm(folder, True)
    runner, sample = llm.engine.runner, llm.engine.runner.sample

    def strict(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return sample(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.sample = strict
    mixes = [
        dict(temperature=0.8, top_k=20, top_p=0.9, seed=1),
        dict(temperature=1.0, min_p=0.05, repetition_penalty=1.2, logprobs=3),
        dict(temperature=0.0, presence_penalty=0.4, frequency_penalty=0.2),
        dict(temperature=0.7, top_p=0.5, logit_bias={5: 2.0}, min_tokens=4),
        dict(temperature=1.3, top_k=5, seed=2, logprobs=0),
        dict(temperature=0.0),
    ]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, **m) for m in mixes]
    outs = _run(llm, _prompts(6, seed=5), params)
    assert all(len(t) == 10 for t, _, _ in outs)
