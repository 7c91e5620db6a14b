"""EngineLoop alone, on the shared real engine: streams equal offline generation, bad input is the
first item, aborts are idempotent at every stage, a dying engine ends every stream, shutdown drains."""

from __future__ import annotations

import asyncio

import pytest

from foveal import SamplingParams
from foveal.engine.loop import EngineLoop, StreamFailed, expand_n
from foveal.request import FinishReason


def chat_ids(llm, text):
    return llm.engine.apply_chat_template([{"role": "user", "content": text}])


async def _collect(stream):
    await stream.admitted()
    out: dict[int, list] = {}
    async for i, d in stream.deltas():
        out.setdefault(i, []).append(d)
    return out


def _run_loop(engine, coro_fn, **kw):
    loop = EngineLoop(engine, **kw)
    assert loop.state == "loading" and loop._thread is None  # the constructor does no work
    loop.start()
    try:
        return asyncio.run(coro_fn(loop))
    finally:
        loop.shutdown(0)


def test_stream_equals_generate_and_n_seeds(llm_fp32):
    ids = chat_ids(llm_fp32, "Name a fruit.")
    p = SamplingParams(temperature=0.8, seed=5, max_tokens=8, n=2)
    ref = llm_fp32.generate([ids], p)[0].outputs

    async def go(loop):
        return await _collect(loop.submit("a", expand_n(ids, p)))

    out = _run_loop(llm_fp32.engine, go)
    for i in range(2):
        assert "".join(d.text for d in out[i]) == ref[i].text
        assert out[i][-1].num_output_tokens == len(ref[i].token_ids)


def test_bad_input_is_the_first_item(llm_fp32):
    async def go(loop):
        s = loop.submit("bad", [(list(range(10)), SamplingParams(max_tokens=10**6))])
        with pytest.raises(StreamFailed) as e:
            await s.admitted()
        assert e.value.error.status == 400 and "max_tokens" in e.value.error.message

        def boom():
            raise ValueError("template exploded")

        s = loop.submit("bad2", [(boom, SamplingParams())])
        with pytest.raises(StreamFailed, match="template exploded"):
            await s.admitted()

    _run_loop(llm_fp32.engine, go)


def test_abort_before_admission_during_run_and_after_finish(llm_fp32):
    ids = chat_ids(llm_fp32, "Tell me a story.")
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def go(loop):
        s = loop.submit("early", [(ids, long)])
        loop.abort("early")
        loop.abort("early")  # idempotent
        out = await _collect(s)
        assert out[0][-1].finish_reason is FinishReason.ABORT
        s = loop.submit("mid", [(ids, long)])
        await s.admitted()
        got = 0
        async for _, d in s.deltas():
            got += 1
            if got == 2:
                loop.abort("mid")
            if d.finished:
                assert d.finish_reason is FinishReason.ABORT
        s = loop.submit("done", [(ids, SamplingParams(temperature=0, max_tokens=2))])
        await _collect(s)
        loop.abort("done")
        loop.abort("never-existed")
        await asyncio.sleep(0.05)
        assert llm_fp32.engine.kv.num_used_blocks == 0

    _run_loop(llm_fp32.engine, go)


def test_engine_failure_marks_loop_dead_and_ends_streams(llm_fp32, monkeypatch):
    eng = llm_fp32.engine
    ids = chat_ids(llm_fp32, "Hello")
    real_step = eng.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device lost")
        return real_step()

    monkeypatch.setattr(eng, "step", flaky)

    async def go(loop):
        s = loop.submit("x", [(ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))])
        with pytest.raises(StreamFailed, match="device lost"):
            await _collect(s)
        assert loop.state == "dead"
        s = loop.submit("y", [(ids, SamplingParams())])
        with pytest.raises(StreamFailed) as e:
            await s.admitted()
        assert e.value.error.status == 503

    _run_loop(eng, go)
    monkeypatch.setattr(eng, "step", real_step)
    while eng.has_unfinished():  # drain the queued abort deltas
        eng.step()


def test_shutdown_aborts_what_does_not_drain(llm_fp32):
    ids = chat_ids(llm_fp32, "Tell me a story.")
    loop = EngineLoop(llm_fp32.engine).start()

    async def go():
        s = loop.submit("slow", [(ids, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))])
        await s.admitted()
        await asyncio.to_thread(loop.shutdown, 0.2)
        with pytest.raises(StreamFailed, match="shutting down"):
            async for _ in s.deltas():
                pass
        assert loop.state == "stopped"

    asyncio.run(go())
    assert llm_fp32.engine.kv.num_used_blocks == 0
