"""Engine and offline API on the real embedded model: seeded sampling across batches, stop rules,
logprobs, streaming, abort, per-request fault isolation and input validation."""

from __future__ import annotations

import dataclasses

import pytest

from foveal import SamplingParams
from foveal.request import FinishReason, InvalidParameter


def chat_ids(llm, text):
    return llm.processor.apply_chat_template([{"role": "user", "content": text}])


def add(llm, prompt, params, request_id=None) -> str:
    return llm.engine.add_request(llm.processor.request(prompt, params, request_id))


OTHERS = [
    "Name a color.",
    "Count to five.",
    "What is 2+2?",
    "Say hello in French.",
    "Describe a cat.",
    "What is rain?",
    "Give me a fruit.",
]


def test_seeded_sampling_is_batch_invariant(llm_fp32):
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    target = chat_ids(llm_fp32, "Write one sentence about mountains.")
    alone = llm_fp32.generate([target], p)[0].outputs[0].token_ids
    others = [chat_ids(llm_fp32, t) for t in OTHERS]
    unseeded = SamplingParams(temperature=1.0, max_tokens=24)
    first = llm_fp32.generate([target] + others, [p] + [unseeded] * 7)[0].outputs[0].token_ids
    outs = llm_fp32.generate(others[:4] + [target] + others[4:], [unseeded] * 4 + [p] + [unseeded] * 3)
    middle = outs[4].outputs[0].token_ids
    assert alone == first == middle
    other_seed = (
        llm_fp32.generate(
            [target], SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=24)
        )[0]
        .outputs[0]
        .token_ids
    )
    assert other_seed != alone


def test_stop_string_is_excluded_and_reported(llm_fp32):
    ids = chat_ids(llm_fp32, "What is the capital of France?")
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=20, stop=["Paris"]))[0].outputs[0]
    assert out.text == "The capital of France is "
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == "Paris"
    out = llm_fp32.generate(
        [ids], SamplingParams(temperature=0, max_tokens=20, stop=["Paris"], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert out.text == "The capital of France is Paris"


def test_length_min_tokens_ignore_eos_and_stop_token(llm_fp32):
    ids = chat_ids(llm_fp32, "What is the capital of France?")
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason is FinishReason.LENGTH
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[
        0
    ]
    assert len(out.token_ids) == 12 and out.finish_reason is FinishReason.LENGTH
    eos = llm_fp32.tokenizer.eos_token_id
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=12, min_tokens=12))[0].outputs[0]
    assert len(out.token_ids) == 12 and eos not in out.token_ids  # EOS masked until min_tokens
    first = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[first[2]]))[
        0
    ].outputs[0]
    assert out.token_ids == first[:3] and out.stop_reason == first[2]


def test_logprobs_and_n(llm_fp32):
    ids = chat_ids(llm_fp32, "Name an animal.")
    out = llm_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and len(lp.top) == 3
        assert lp.top[0].token_id == tok  # greedy picks the most likely token
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob and lp.logprob <= 0
    res = llm_fp32.generate([ids], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8))[0]
    assert [o.index for o in res.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1


def test_stream_equals_generate(llm_fp32):
    ids = chat_ids(llm_fp32, "Write a short poem about the moon.")
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=30)
    full = llm_fp32.generate([ids], p)[0].outputs[0]
    deltas = list(llm_fp32.stream(ids, p))
    assert "".join(d.text for d in deltas) == full.text
    assert [t for d in deltas for t in d.token_ids] == full.token_ids
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])


def test_abort_frees_blocks_at_once(llm_fp32):
    eng = llm_fp32.engine
    rid = add(llm_fp32, chat_ids(llm_fp32, "Tell me a long story."), SamplingParams(max_tokens=100))
    eng.step()
    eng.step()
    assert eng.kv.num_used_blocks > 0
    assert eng.abort(rid) and not eng.abort(rid)  # idempotent
    assert eng.kv.num_used_blocks == 0
    deltas = eng.step()
    assert [(d.request_id, d.finish_reason) for d in deltas] == [(rid, FinishReason.ABORT)]
    # abort before the first step
    rid = add(llm_fp32, [1, 2, 3], SamplingParams(max_tokens=5))
    assert eng.abort(rid)
    assert [d.finish_reason for d in eng.step()] == [FinishReason.ABORT]


def test_fault_in_one_request_leaves_others_intact(llm_fp32, monkeypatch):
    """A detokenizer that raises for one request ends only that request, with an error."""
    eng = llm_fp32.engine
    ok_ids = chat_ids(llm_fp32, "What is the capital of France?")
    good = add(llm_fp32, ok_ids, SamplingParams(temperature=0, max_tokens=20))
    bad = add(llm_fp32, ok_ids, SamplingParams(temperature=0, max_tokens=20))
    det = eng._tracked[bad].detok

    def boom(_ids):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(det, "add", boom)
    texts, finals = {}, {}
    while eng.has_unfinished():
        for d in eng.step():
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
            if d.finished:
                finals[d.request_id] = d
    assert finals[bad].finish_reason is FinishReason.ERROR and "injected fault" in finals[bad].error
    assert (
        finals[good].finish_reason is FinishReason.STOP and texts[good] == "The capital of France is Paris."
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(logprobs=21), "logprobs"),
        (dict(min_p=2.0), "min_p"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(stop=[""]), "stop"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_bad_sampling_values_are_rejected(kwargs, field):
    with pytest.raises(InvalidParameter, match=field) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field
    good = SamplingParams()
    with pytest.raises(InvalidParameter, match=field):  # a copy is validated too
        dataclasses.replace(good, **kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        good.temperature = 0.5


def test_bad_requests_are_rejected(llm_fp32):
    """The input processor refuses bad input before anything is admitted; the engine only checks ids."""
    proc, eng = llm_fp32.processor, llm_fp32.engine
    limit = proc.info.max_model_len
    with pytest.raises(ValueError, match="context"):
        proc.request([5] * limit, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="exceeds the context"):
        proc.request([5] * 10, SamplingParams(max_tokens=limit))
    with pytest.raises(ValueError, match="empty"):
        proc.request("", SamplingParams())
    with pytest.raises(InvalidParameter, match="logit_bias") as e:
        proc.request([5], SamplingParams(logit_bias={10**9: 1.0}))
    assert e.value.param == "logit_bias"
    with pytest.raises(InvalidParameter, match="stop_token_ids"):
        proc.request([5], SamplingParams(stop_token_ids=[proc.info.vocab_size]))
    with pytest.raises(ValueError, match="token ids"):
        proc.request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="messages"):
        llm_fp32.chat([])
    with pytest.raises(ValueError, match="requests"):
        proc.request([5], SamplingParams(n=2))
    r = proc.request([5, 6], SamplingParams(max_tokens=None), "dup")
    assert r.params.max_tokens == limit - 2  # what the context leaves, filled in on the request side
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.request_id = "other"
    eng.add_request(r)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(r)
    assert eng.abort("dup")
    eng.step()
    assert not eng.has_unfinished()


def test_n_expands_on_the_request_side(llm_fp32):
    """requests(): one EngineRequest per choice, named {id}-{i}, seeded choices seed + i; n == 1 keeps
    the id."""
    proc = llm_fp32.processor
    many = proc.requests([1, 2, 3], SamplingParams(n=3, seed=7), "r", cache_salt="t")
    assert [(r.request_id, r.params.n, r.params.seed) for r in many] == [
        ("r-0", 1, 7),
        ("r-1", 1, 8),
        ("r-2", 1, 9),
    ]
    assert all(r.cache_salt == "t" and r.prompt_token_ids == (1, 2, 3) for r in many)
    (one,) = proc.requests([1, 2, 3], SamplingParams(), "s")
    assert one.request_id == "s"


def test_missing_and_corrupt_model_paths(tmp_path):
    from foveal.engine.llm import LLM
    from foveal.loader import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope.gguf"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError):
        LLM(str(bad))
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(max_num_seq=3)


def test_preemption_on_real_model_gives_same_greedy_tokens(llm_fp32):
    """A pool of 11 usable blocks (176 tokens) for 4 requests that need up to 5 blocks each forces
    preemption by recompute; the greedy tokens equal the unconstrained engine's."""
    from foveal.engine.llm import LLM

    prompts = [
        chat_ids(llm_fp32, t)
        for t in (
            "Describe the ocean.",
            "Why do birds sing?",
            "What is a computer?",
            "Explain gravity simply.",
        )
    ]
    assert all(len(p) <= 40 for p in prompts)
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, p)]
    # dense, as llm_fp32: with int8 activations the recompute's prefill rounds differently from decode
    tight = LLM(dtype="float32", quantization="none", num_blocks=12, block_size=16, max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, p)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == want
    tight.engine.kv.check_integrity()
    assert tight.engine.kv.num_used_blocks == 0


def test_token_budget_default_depends_on_device_and_use(llm_fp32):
    """No --max-num-batched-tokens: 2048 per step, but 128 for a server on CPU (`foveal serve` sets
    `serving`; tests/test_server.py checks the running server, tests/test_gpu.py CUDA); a given value is
    kept as it is."""
    from foveal.config import EngineConfig

    assert EngineConfig.from_kwargs().scheduler.max_num_batched_tokens is None
    assert llm_fp32.engine.config.scheduler.max_num_batched_tokens == 2048  # offline LLM on CPU
    assert llm_fp32.engine.scheduler.config.max_num_batched_tokens == 2048
    serving = EngineConfig.from_kwargs(serving=True).scheduler
    assert serving.for_device("cpu").max_num_batched_tokens == 128
    assert serving.for_device("cuda").max_num_batched_tokens == 2048
    assert EngineConfig.from_kwargs(max_num_batched_tokens=64).scheduler.max_num_batched_tokens == 64
    assert (
        EngineConfig.from_kwargs(max_num_batched_tokens=64, serving=True)
        .scheduler.for_device("cpu")
        .max_num_batched_tokens
        == 64
    )
