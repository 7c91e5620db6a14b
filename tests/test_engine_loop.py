"""EngineLoop alone, on the shared real engine: streams equal offline generation, bad input is the
first item, aborts are idempotent at every stage, a dying engine ends every stream, shutdown drains."""

from __future__ import annotations

import asyncio

import pytest

from foveal import SamplingParams
from foveal.engine.loop import EngineLoop, ErrorKind, RequestStream, StreamError, StreamFailed
from foveal.request import FinishReason, TokenDelta, TokenLogprobs


def chat_ids(llm, text):
    return llm.processor.apply_chat_template([{"role": "user", "content": text}])


def reqs(llm, rid, ids, params):
    """What the server submits: the request's sequences, processed on the request side."""
    return llm.processor.requests(ids, params, rid)


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
        return await _collect(loop.submit("a", reqs(llm_fp32, "a", ids, p)))

    out = _run_loop(llm_fp32.engine, go)
    for i in range(2):
        assert "".join(d.text for d in out[i]) == ref[i].text
        assert out[i][-1].num_output_tokens == len(ref[i].token_ids)


def test_a_slow_consumer_reads_merged_deltas(llm_fp32):
    """A caller that sleeps between reads finds several steps queued: it gets one delta per choice
    holding all of them, and the text, tokens and final counts still equal offline generation."""
    ids = chat_ids(llm_fp32, "Count to ten.")
    p = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, n=2)
    ref = llm_fp32.generate([ids], p)[0].outputs

    async def go(loop):
        s = loop.submit("slow", reqs(llm_fp32, "slow", ids, p))
        await s.admitted()
        out: dict[int, list] = {}
        async for i, d in s.deltas():
            out.setdefault(i, []).append(d)
            await asyncio.sleep(0.2)  # several engine steps land while we sleep
        return out

    out = _run_loop(llm_fp32.engine, go)
    for i in range(2):
        assert [t for d in out[i] for t in d.token_ids] == ref[i].token_ids
        assert "".join(d.text for d in out[i]) == ref[i].text
        assert out[i][-1].finished and out[i][-1].num_output_tokens == 24
    assert min(len(out[0]), len(out[1])) < 24  # merging happened (each choice has 24 tokens)


def test_merging_keeps_order_logprobs_and_a_trailing_error():
    async def go():
        s = RequestStream("r", 2, asyncio.get_running_loop(), None)
        lp = [TokenLogprobs(k, -1.0, []) for k in range(4)]
        s.queue.put_nowait((0, TokenDelta("r-0", [1], "a", [lp[0]])))
        s.queue.put_nowait((1, TokenDelta("r-1", [2], "b")))
        s.queue.put_nowait((0, TokenDelta("r-0", [3], "c", [lp[1]], finish_reason=FinishReason.LENGTH)))
        s.queue.put_nowait(StreamError("engine died", ErrorKind.UNAVAILABLE))
        got = []
        with pytest.raises(StreamFailed, match="engine died"):
            async for i, d in s.deltas():
                got.append((i, d))
        return got

    got = asyncio.run(go())
    assert [i for i, _ in got] == [0, 1]
    d0, d1 = got[0][1], got[1][1]
    assert (d0.token_ids, d0.text, d0.finish_reason) == ([1, 3], "ac", FinishReason.LENGTH)
    assert [x.token_id for x in d0.logprobs] == [0, 1]
    assert (d1.token_ids, d1.text, d1.logprobs, d1.finished) == ([2], "b", None, False)


def test_bad_input_is_the_first_item(llm_fp32):
    """What the loop itself refuses (input was checked on the request side) comes as the stream's first
    item: an id already open, and more sequences than the queue can ever hold, are 400s; nothing of
    either stays admitted."""
    ids = chat_ids(llm_fp32, "Tell me a story.")
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def go(loop):
        first = loop.submit("same", reqs(llm_fp32, "same", ids, long))
        await first.admitted()
        again = loop.submit("same", reqs(llm_fp32, "same", ids, long))
        with pytest.raises(StreamFailed) as e:
            await again.admitted()
        assert e.value.error.kind is ErrorKind.INVALID_REQUEST and "already in use" in e.value.error.message
        loop.abort("same")
        assert (await _collect(first))[0][-1].finish_reason is FinishReason.ABORT
        many = loop.submit("many", reqs(llm_fp32, "many", ids, SamplingParams(n=3)))
        with pytest.raises(StreamFailed) as e:
            await many.admitted()
        assert e.value.error.kind is ErrorKind.INVALID_REQUEST and "at most 2" in e.value.error.message
        await asyncio.sleep(0.05)
        assert llm_fp32.engine.kv.num_used_blocks == 0

    _run_loop(llm_fp32.engine, go, max_queued_requests=2)


def test_abort_before_admission_during_run_and_after_finish(llm_fp32):
    ids = chat_ids(llm_fp32, "Tell me a story.")
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def go(loop):
        s = loop.submit("early", reqs(llm_fp32, "early", ids, long))
        loop.abort("early")
        loop.abort("early")  # idempotent
        out = await _collect(s)
        assert out[0][-1].finish_reason is FinishReason.ABORT
        s = loop.submit("mid", reqs(llm_fp32, "mid", ids, long))
        await s.admitted()
        got = 0
        async for _, d in s.deltas():
            got += 1
            if got == 2:
                loop.abort("mid")
            if d.finished:
                assert d.finish_reason is FinishReason.ABORT
        s = loop.submit("done", reqs(llm_fp32, "done", ids, SamplingParams(temperature=0, max_tokens=2)))
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
        s = loop.submit(
            "x", reqs(llm_fp32, "x", ids, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        )
        with pytest.raises(StreamFailed, match="device lost"):
            await _collect(s)
        assert loop.state == "dead"
        s = loop.submit("y", reqs(llm_fp32, "y", ids, SamplingParams()))
        with pytest.raises(StreamFailed) as e:
            await s.admitted()
        assert e.value.error.kind is ErrorKind.UNAVAILABLE

    _run_loop(eng, go)
    monkeypatch.setattr(eng, "step", real_step)
    while eng.has_unfinished():  # drain the queued abort deltas
        eng.step()


def test_shutdown_aborts_what_does_not_drain(llm_fp32):
    ids = chat_ids(llm_fp32, "Tell me a story.")
    loop = EngineLoop(llm_fp32.engine).start()

    async def go():
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        s = loop.submit("slow", reqs(llm_fp32, "slow", ids, long))
        await s.admitted()
        await asyncio.to_thread(loop.shutdown, 0.2)
        with pytest.raises(StreamFailed, match="shutting down"):
            async for _ in s.deltas():
                pass
        assert loop.state == "stopped"

    asyncio.run(go())
    assert llm_fp32.engine.kv.num_used_blocks == 0
