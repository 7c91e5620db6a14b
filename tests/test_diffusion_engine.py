"""Diffusion LMs in the engine loop: each sampler equals a reference of its published algorithm
(tests/diffusion_reference.py, transformers on the same random weights), batched equals alone, a
cached prefix equals none, one streamed chunk per final block, bad requests refused by name."""

from __future__ import annotations

import pytest
import torch

from foveal import SamplingParams
from foveal.diffusion.sampling import uniforms
from foveal.diffusion.state import DiffusionParams
from foveal.request import InvalidParameter
from tests.diffusion_models import EOS_ID, MASK_ID, hf_model, write_llada, write_sdar
from tests.diffusion_reference import block_generate, llada_generate


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    path = write_llada(tmp_path_factory.mktemp("llada"), seed=0)
    return path, hf_model(path)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    path = write_sdar(tmp_path_factory.mktemp("sdar"), seed=1, block_size=4)
    return path, hf_model(path)


def _llm(path, **kw):
    from foveal.engine.llm import LLM

    opts = dict(dtype="float32", num_blocks=256, block_size=4, max_num_seqs=8, max_model_len=256)
    return LLM(path, **{**opts, **kw})


def _prompts(n: int, seed: int, lo: int = 3, hi: int = 14) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(lo, hi, (1,), generator=g))
        out.append(torch.randint(3, 250, (k,), generator=g).tolist())
    return out


def _gen(llm, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    eng = llm.engine
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished() and eng.runner.num_held == 0
    return [list(o.outputs[0].token_ids) for o in outs]


def _uniforms(seed):
    return lambda index, shape: uniforms(seed, index, shape[0], shape[1], "cpu")


# -- each sampler against its reference ------------------------------------------------------------
@pytest.mark.parametrize(
    "steps,block,gen,temperature",
    [(4, 4, 8, 0.0), (2, 8, 16, 0.0), (8, 8, 8, 0.0), (3, 4, 12, 0.9), (6, 4, 12, 0.9)],
)
def test_masked_diffusion_equals_llada_generate(llada, steps, block, gen, temperature):
    """LLaDA's sampler (low-confidence remasking, semi-autoregressive blocks; `steps` per block here,
    the reference's total is steps x blocks), greedy and sampled with a seed."""
    path, hf = llada
    llm = _llm(path)
    prompts = _prompts(3, seed=steps + gen)
    knobs = DiffusionParams(steps=steps, block_length=block)
    for i, p in enumerate(prompts):
        params = SamplingParams(
            temperature=temperature, seed=100 + i, max_tokens=gen, ignore_eos=True, diffusion=knobs
        )
        [got] = _gen(llm, [p], params)
        want = llada_generate(
            hf, p, steps=steps * (gen // block), gen_length=gen, block_length=block,
            temperature=temperature, mask_id=MASK_ID, uniforms=_uniforms(100 + i),
        )  # fmt: skip
        assert got == want, (p, got, want)


BLOCK_CASES = [
    ("low_confidence_static", 4, None, 0.0),
    ("low_confidence_static", 2, None, 0.0),
    ("low_confidence_dynamic", 4, 0.5, 0.0),
    ("threshold", None, 0.5, 0.0),
    ("threshold", None, 1.0, 0.0),  # one token per forward
    ("low_confidence_dynamic", 3, 0.4, 0.8),
]


@pytest.mark.parametrize("strategy,steps,threshold,temperature", BLOCK_CASES)
def test_block_diffusion_equals_the_reference(sdar, strategy, steps, threshold, temperature):
    """SDAR's block diffusion (static and dynamic low-confidence rules) and Fast-dLLM's threshold rule,
    prompts that end inside a block and on a boundary, committed blocks' K/V kept in the paged cache."""
    path, hf = sdar
    llm = _llm(path)
    knobs = DiffusionParams(steps=steps, threshold=threshold)
    for i, p in enumerate(_prompts(3, seed=7, lo=4, hi=13) + [list(range(5, 13))]):
        params = SamplingParams(
            temperature=temperature, seed=i, max_tokens=10, ignore_eos=True, diffusion=knobs
        )
        [got] = _gen(llm, [p], params)
        want = block_generate(
            hf, p, block_size=4, gen_length=10, mask_id=MASK_ID, steps_per_block=steps, strategy=strategy,
            threshold=0.9 if threshold is None else threshold, temperature=temperature, uniforms=_uniforms(i),
        )  # fmt: skip
        assert got == want, (p, got, want)


def test_block_diffusion_stops_at_eos(sdar):
    """Without ignore_eos the request ends at the first EOS of a final block (not in the output)."""
    path, hf = sdar
    llm = _llm(path)
    knobs = DiffusionParams(steps=2)
    for p in _prompts(6, seed=11):
        want = block_generate(
            hf, p, block_size=4, gen_length=24, mask_id=MASK_ID, steps_per_block=2,
            strategy="low_confidence_static", stop_ids=(EOS_ID,),
        )  # fmt: skip
        [got] = _gen(llm, [p], SamplingParams(temperature=0, max_tokens=24, diffusion=knobs))
        assert got == (want[:-1] if want and want[-1] == EOS_ID else want)


# -- batching, caching, streaming --------------------------------------------------------------------
def test_a_batch_of_diffusion_requests_equals_each_alone(llada, sdar):
    """8 requests of different lengths and knobs in one batch (chunks of several requests per step)
    give what each gives alone; seeded sampled ones too."""
    for path, knobs in (
        (llada[0], [DiffusionParams(steps=s, block_length=b) for s, b in ((2, 4), (4, 4), (1, 8), (3, 8))]),
        (
            sdar[0],
            [
                DiffusionParams(steps=2),
                DiffusionParams(threshold=0.5),
                DiffusionParams(steps=4),
                DiffusionParams(steps=3, threshold=0.3),
            ],
        ),  # fmt: skip
    ):
        prompts = _prompts(8, seed=3)
        params = [
            SamplingParams(
                temperature=0.0 if i % 3 else 0.7,
                seed=i,
                max_tokens=8 + 4 * (i % 3),
                ignore_eos=True,
                diffusion=knobs[i % 4],
            )  # fmt: skip
            for i in range(8)
        ]
        llm = _llm(path)
        together = _gen(llm, prompts, params)
        alone = [_gen(llm, [p], q)[0] for p, q in zip(prompts, params)]
        assert together == alone
        assert all(len(t) == q.max_tokens for t, q in zip(together, params))


def test_async_scheduling_gives_the_same_diffusion_outputs(llada, sdar):
    """With async scheduling (on for CUDA) a diffusion step runs alone, and its tokens are emitted only
    after the next step is launched: the outputs equal the synchronous engine's, for both kinds,
    greedy and seeded."""
    for path, knob in (
        (llada[0], DiffusionParams(steps=2, block_length=4)),
        (sdar[0], DiffusionParams(steps=2)),
    ):
        prompts = _prompts(5, seed=6)
        params = [
            SamplingParams(
                temperature=0.0 if i % 2 else 0.7, seed=i, max_tokens=8, ignore_eos=True, diffusion=knob
            )
            for i in range(5)
        ]
        sync = _gen(_llm(path, async_scheduling=False), prompts, params)
        over = _llm(path, async_scheduling=True)
        eng, waiting = over.engine, []  # how many requests' tokens each launch found unemitted
        flush = eng._emit_deferred
        eng._emit_deferred = lambda e=eng, w=waiting, f=flush: w.append(len(e._unemitted)) or f()
        assert _gen(over, prompts, params) == sync
        assert max(waiting) > 0


@pytest.mark.parametrize("block", [4, 8])
def test_block_diffusion_with_a_cached_prefix_equals_without(sdar, tmp_path, block):
    """The second request with the same long prompt reuses the committed blocks' K/V (a prefix hit of
    whole attention blocks: with blocks of 8 over KV blocks of 4 the hit stops at a block of 8) and
    gives the same tokens; so does a request whose prompt ends mid-block."""
    path = sdar[0] if block == 4 else write_sdar(tmp_path, seed=2, block_size=8)
    knobs = DiffusionParams(steps=2)
    base = _prompts(1, seed=5, lo=30, hi=31)[0]
    for prompt in (base, base[:-2]):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, diffusion=knobs)
        cold = _gen(_llm(path, enable_prefix_caching=False), [prompt], params)
        llm = _llm(path)
        first = _gen(llm, [prompt], params)
        hits = llm.engine.kv.hit_tokens
        again = _gen(llm, [prompt], params)
        assert first == cold == again
        # whole blocks of the prompt came from the cache (and only whole attention blocks of 4)
        cached = llm.engine.kv.hit_tokens - hits
        assert cached >= 16 and cached % block == 0


def test_streaming_gives_one_chunk_per_final_block(llada, sdar):
    """Each engine delta of a diffusion request is one block's tokens, and they join to the output."""
    for path, knobs, block in (
        (llada[0], DiffusionParams(steps=2, block_length=4), 4),
        (sdar[0], DiffusionParams(steps=2), 4),
    ):
        llm = _llm(path)
        eng = llm.engine
        prompt = _prompts(1, seed=9, lo=6, hi=7)[0]  # 6 tokens: SDAR's first block generates 2
        params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, diffusion=knobs)
        rid = eng.add_request(llm.processor.request(prompt, params))
        chunks = []
        while eng.has_unfinished():
            chunks += [d.token_ids for d in eng.step() if d.request_id == rid and d.token_ids]
        want = _gen(llm, [prompt], params)[0]
        assert [t for c in chunks for t in c] == want
        sizes = [len(c) for c in chunks]
        if "llada" in path:
            assert sizes == [4, 4, 4, 2]
        else:
            assert sizes == [2, 4, 4, 4]
        assert block == 4


# -- refusals ------------------------------------------------------------------------------------------
def test_diffusion_requests_refuse_what_they_do_not_apply(llada, sdar):
    llm = _llm(sdar[0])
    for field, value in (("logprobs", 2), ("repetition_penalty", 1.2), ("min_p", 0.1), ("min_tokens", 2)):
        with pytest.raises(InvalidParameter, match=field) as e:
            llm.processor.request([5, 6, 7], SamplingParams(max_tokens=8, **{field: value}))
        assert e.value.param == field
    with pytest.raises(InvalidParameter, match="blocks of 4"):
        llm.processor.request([5, 6], SamplingParams(max_tokens=8, diffusion=DiffusionParams(block_length=8)))
    masked = _llm(llada[0], max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="token budget is 64"):
        masked.processor.request(list(range(5, 40)), SamplingParams(max_tokens=40))


def test_diffusion_knobs_on_an_autoregressive_model_are_refused(tmp_path):
    from tests.test_loader import tiny_hf_tokenizer, tiny_model

    model = tiny_model("llama", seed=0)
    model.save_pretrained(tmp_path)
    tiny_hf_tokenizer().save_pretrained(tmp_path)
    llm = _llm(str(tmp_path))
    with pytest.raises(InvalidParameter, match="not a diffusion model"):
        llm.processor.request([5, 6], SamplingParams(max_tokens=4, diffusion=DiffusionParams(steps=2)))
    with pytest.raises(InvalidParameter, match="steps"):
        DiffusionParams(steps=0)


def test_cancelled_diffusion_requests_leak_no_blocks(sdar, llada):
    for path in (sdar[0], llada[0]):
        llm = _llm(path)
        eng = llm.engine
        params = SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, diffusion=DiffusionParams(steps=4)
        )
        rids = [eng.add_request(llm.processor.request(p, params)) for p in _prompts(4, seed=2)]
        for _ in range(3):
            eng.step()
        eng.abort(rids[0])
        eng.abort(rids[2])
        while eng.has_unfinished():
            eng.step()
        eng.kv.check_integrity()
        assert eng.kv.num_used_blocks == 0 and eng.runner.num_held == 0


# -- the HTTP edge --------------------------------------------------------------------------------
def test_served_diffusion_streams_blocks_and_refuses_by_name(tmp_path):
    """Through the official client (a dummy-weight SDAR config: the synthetic tokenizer spells token i
    " t<i>", so every token has text): the knobs as an extra body object, the stream's content deltas
    one per final block joining to the whole text, a 400 naming a refused field."""
    import itertools
    import json

    import openai

    from tests.diffusion_models import sdar_config
    from tests.test_server import serving

    cfg = tmp_path / "sdar.json"
    cfg.write_text(json.dumps(sdar_config(block_size=4)))
    knobs = {"diffusion": {"steps": 2}}
    engine = {"model": str(cfg), "load_format": "dummy", "block_size": 4, "max_model_len": 256}
    with serving({**engine, "diffusion_config": {"threshold": 0.5}}, {}) as s:
        c = s.client()
        args = dict(model=s.model, prompt="t5 t6 t7 t8 t9 t10", max_tokens=14, temperature=0.0)
        whole = c.completions.create(**args, extra_body={**knobs, "ignore_eos": True})
        text = whole.choices[0].text
        assert whole.usage.completion_tokens == 14 and text
        parts = [
            ch.choices[0].text
            for ch in c.completions.create(**args, stream=True, extra_body={**knobs, "ignore_eos": True})
            if ch.choices and ch.choices[0].text
        ]
        assert "".join(parts) == text and len(parts) >= 2
        # one chunk per final block, or several blocks in one where the client read after them (the
        # engine loop merges a slow consumer's deltas): each chunk ends where a block of 4 ends
        ends = itertools.accumulate(len(p.split()) for p in parts)
        assert all((whole.usage.prompt_tokens + n) % 4 == 0 for n in ends), parts
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**args, logprobs=2)
        assert "logprobs" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(**args, extra_body={"diffusion": {"steps": 0}})
        assert "steps" in str(e.value)
        # counted like any request: two finished, 28 generated tokens
        import httpx

        metrics = httpx.get(s.url + "/metrics").text
        assert "foveal_generation_tokens_total 28.0" in metrics, metrics[:400]
    assert s.engine.kv.num_used_blocks == 0


def test_server_default_knobs_fill_what_a_request_leaves_out(llada):
    llm = _llm(llada[0], diffusion_config={"steps": 3, "block_length": 8, "threshold": 0.4})
    req = llm.processor.request([5, 6, 7], SamplingParams(max_tokens=16))
    assert req.params.diffusion == DiffusionParams(steps=3, block_length=8, threshold=0.4)
    own = DiffusionParams(steps=5, block_length=4)
    req = llm.processor.request([5, 6, 7], SamplingParams(max_tokens=16, diffusion=own))
    assert req.params.diffusion == DiffusionParams(steps=5, block_length=4, threshold=0.4)


def test_block_diffusion_rows_eager_equal_the_decode_graphs(sdar):
    """A block model's rows are one-token queries seeing their block's end: the recorded decode-step
    graphs (explicit slots) and the eager path give the same tokens."""
    path, _ = sdar
    prompts = _prompts(5, seed=21)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, diffusion=DiffusionParams(steps=2))
    graphs = _llm(path)
    assert graphs.engine.runner.graphs is not None
    eager = _llm(path, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    assert _gen(graphs, prompts, params) == _gen(eager, prompts, params)


def test_block_rows_grouped_by_request_equal_the_plain_rows(sdar, monkeypatch):
    """The Triton backend (the interpreter on a CPU) reads a request's keys once for all of its block's
    rows (request_rows_min_tokens: from 4 keys on; on by itself for a block model): the same tokens as
    the CPU backend's rows."""
    from foveal.attention.kernels import decode

    path, _ = sdar
    prompts = _prompts(2, seed=23, lo=6, hi=12)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, diffusion=DiffusionParams(steps=2))
    launches = []
    real = decode.shared_prefix_attention
    monkeypatch.setattr(decode, "shared_prefix_attention", lambda *a: launches.append(1) or real(*a))
    grouped = _llm(path, attention_backend="triton", request_rows_min_tokens=4, shared_prefix_min_rows=0)
    assert grouped.engine.runner.backend.request_min_prefix == 4
    grouped.engine.runner.backend.request_min_groups = 1  # steps of any size (the default: 32 requests)
    assert _gen(grouped, prompts, params) == _gen(_llm(path), prompts, params)
    assert launches


def test_recomputing_the_prefix_gives_what_the_block_cache_gives(sdar):
    """The benchmark's yardstick (no K/V kept, the prefix computed again in every pass) is the same
    sampler: the same tokens, and nothing held in the pool between passes."""
    path, _ = sdar
    prompts = _prompts(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, diffusion=DiffusionParams(steps=2))
    cached = _gen(_llm(path), prompts, params)
    llm = _llm(path)
    llm.engine.scheduler.diffusion.recompute_prefix = True
    seen = []
    schedule = llm.engine.scheduler.schedule

    def watching():
        batch = schedule()
        seen.extend(s.start for s in batch.items)
        return batch

    llm.engine.scheduler.schedule = watching
    assert _gen(llm, prompts, params) == cached
    assert seen and set(seen) == {0}  # every pass from position 0


def test_preempted_diffusion_requests_give_what_they_give_alone(llada, sdar):
    """A KV pool too small for every request at once: block models' requests are preempted (and
    recompute their committed blocks), masked ones (holding nothing between passes) wait their turn;
    each still gives the tokens it gives alone."""
    for path, pool in ((sdar[0], 10), (llada[0], 9)):
        prompts = _prompts(6, seed=17, lo=8, hi=14)
        params = SamplingParams(
            temperature=0, max_tokens=20, ignore_eos=True, diffusion=DiffusionParams(steps=2, block_length=4)
        )
        alone = [_gen(_llm(path), [p], params)[0] for p in prompts[:2]]
        tight = _llm(path, num_blocks=pool)
        got = _gen(tight, prompts, params)
        assert tight.engine.scheduler.num_preemptions > 0 or path == llada[0]
        assert got[:2] == alone
        assert got == _gen(_llm(path), prompts, params)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(0.0, 5, 1.0), (0.0, 0, 0.5), (0.8, 20, 0.9), (1.0, 0, 0.7)]
)
def test_top_k_and_top_p_filter_the_choice_and_renormalise_the_confidence(
    llada, sdar, temperature, top_k, top_p
):
    """top_k / top_p drop tokens before the choice; the confidence is renormalised over the rest (so
    they change which positions unmask even when greedy): both kinds against their references."""
    for path, hf, kind in ((sdar[0], sdar[1], "block"), (llada[0], llada[1], "masked")):
        llm = _llm(path)
        for i, p in enumerate(_prompts(2, seed=31)):
            knobs = DiffusionParams(steps=2, block_length=4)
            params = SamplingParams(
                temperature=temperature, top_k=top_k, top_p=top_p, seed=50 + i, max_tokens=8, ignore_eos=True,
                diffusion=knobs,
            )  # fmt: skip
            [got] = _gen(llm, [p], params)
            common = dict(
                temperature=temperature, mask_id=MASK_ID, uniforms=_uniforms(50 + i), top_k=top_k, top_p=top_p
            )
            if kind == "block":
                want = block_generate(
                    hf,
                    p,
                    block_size=4,
                    gen_length=8,
                    steps_per_block=2,
                    strategy="low_confidence_static",
                    **common,
                )
            else:
                want = llada_generate(hf, p, steps=4, gen_length=8, block_length=4, **common)
            assert got == want, (kind, p, got, want)


# -- the extra knobs, on the canvas alone ----------------------------------------------------------
def _state(**knobs):
    from foveal.diffusion.state import DiffusionState

    return DiffusionState("masked", 99, [1, 2], 6, DiffusionParams(block_length=6, **knobs), 0)


def test_max_tokens_per_step_caps_each_pass_and_the_block_still_ends():
    st = _state(threshold=0.0, max_tokens_per_step=2)  # every position passes the threshold
    conf = [0.1, 0.9, 0.5, 0.7, 0.3, 0.2]
    x0 = [10, 11, 12, 13, 14, 15]
    assert st.observe(x0, conf) == [] and st.canvas == [99, 11, 99, 13, 99, 99]  # the two most confident
    assert st.observe(x0, conf) == [] and st.canvas == [99, 11, 12, 13, 14, 99]
    assert st.observe(x0, conf) == x0  # the last two: the block is final
    capped = _state(steps=2, max_tokens_per_step=1)  # a schedule of 3 + 3 held back to 1 per pass
    for n in range(1, 6):
        assert capped.observe(x0, conf) == [] and capped.canvas.count(99) == 6 - n
    assert capped.observe(x0, conf) == x0


def test_min_threshold_lowers_the_threshold_over_the_blocks_steps():
    st = _state(steps=3, threshold=0.9, min_threshold=0.5)  # passes at 0.9, 0.7, 0.5
    conf = [0.8, 0.72, 0.95, 0.71, 0.4, 0.75]
    x0 = [10, 11, 12, 13, 14, 15]
    st.observe(x0, conf)  # > 0.9: position 2 only, topped up to the schedule's 2 with 0
    assert [i for i, t in enumerate(st.canvas) if t != 99] == [0, 2]
    st.observe(x0, conf)  # > 0.7: 5, 1 and 3 (at 0.9 it would be the schedule's 2: 5 and 1)
    assert [i for i, t in enumerate(st.canvas) if t != 99] == [0, 1, 2, 3, 5]
    assert st.observe(x0, conf) == x0  # > 0.5: none; the last masked one by the schedule
    with pytest.raises(InvalidParameter, match="min_threshold"):
        DiffusionParams(min_threshold=0.5)
    with pytest.raises(InvalidParameter, match="max_tokens_per_step"):
        DiffusionParams(max_tokens_per_step=0)


def test_one_token_per_pass_when_capped_in_the_engine(llada):
    llm = _llm(llada[0])
    knobs = DiffusionParams(threshold=0.0, max_tokens_per_step=1, block_length=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, diffusion=knobs)
    passes = 0
    schedule = llm.engine.scheduler.schedule

    def counting():
        nonlocal passes
        batch = schedule()
        passes += sum(s.denoise >= 0 for s in batch.items)
        return batch

    llm.engine.scheduler.schedule = counting
    [got] = _gen(llm, [[5, 6, 7]], params)
    assert len(got) == 8 and passes == 8


@pytest.mark.parametrize("editing,stability,post", [(0.0, 2, 3), (0.3, 1, 16), (0.05, 3, 5)])
def test_editing_rewrites_unmasked_positions_like_the_reference(sdar, editing, stability, post):
    """mlx-vlm's editing: earlier unmasked positions take a differing token above the editing
    threshold, and a filled block runs until it holds still (or its post-fill passes run out)."""
    path, hf = sdar
    llm = _llm(path)
    knobs = DiffusionParams(
        steps=2, editing_threshold=editing, stability_steps=stability, max_post_steps=post
    )
    for p in _prompts(3, seed=41) + [list(range(5, 13))]:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, diffusion=knobs)
        [got] = _gen(llm, [p], params)
        want = block_generate(
            hf, p, block_size=4, gen_length=10, mask_id=MASK_ID, steps_per_block=2,
            strategy="low_confidence_static", editing_threshold=editing, stability_steps=stability,
            max_post_steps=post,
        )  # fmt: skip
        assert got == want, (p, got, want)
    with pytest.raises(InvalidParameter, match="needs editing_threshold"):
        DiffusionParams(stability_steps=2)


def test_a_bad_diffusion_config_is_refused_at_start():
    from foveal.config import EngineConfig

    with pytest.raises(ValueError, match="unexpected keyword"):
        EngineConfig.from_kwargs(diffusion_config={"stepz": 3})
    with pytest.raises(ValueError, match="threshold"):
        EngineConfig.from_kwargs(diffusion_config={"threshold": 2.0})


def test_speculation_is_refused_for_a_diffusion_model(sdar):
    with pytest.raises(ValueError, match="speculative decoding does not apply"):
        _llm(sdar[0], speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_a_budget_under_two_blocks_commits_in_a_pass_of_its_own(sdar):
    """With fewer than 2 x block_size tokens per step the final window's commit cannot share the next
    window's pass: it runs alone, and the tokens are the same."""
    path, _ = sdar
    prompts = _prompts(3, seed=23, lo=3, hi=8)  # < 8 tokens: no prompt chunk starts past position 0
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, diffusion=DiffusionParams(steps=2))
    tight = _llm(path, max_num_batched_tokens=6)
    commits = []
    schedule = tight.engine.scheduler.schedule

    def watching():
        batch = schedule()
        commits.extend(s for s in batch.items if s.denoise < 0 and s.num_tokens == 4 and s.start >= 4)
        return batch

    tight.engine.scheduler.schedule = watching
    assert _gen(tight, prompts, params) == _gen(_llm(path), prompts, params)
    assert commits  # commits ran as passes of their own


def test_lora_adapters_on_a_block_diffusion_model(sdar, tmp_path):
    """Adapters compose with denoising passes: a batch mixing two adapters and base requests equals
    each request alone, and an adapter changes the output."""
    from foveal import LoRARequest
    from tests.lora_models import random_adapter

    path, _ = sdar
    llm = _llm(path, enable_lora=True, max_loras=2, max_lora_rank=8)
    layout = llm.engine.runner.lora.layout
    ads = [LoRARequest(f"d{i}", random_adapter(tmp_path / str(i), layout, 8, seed=i)) for i in range(2)]
    prompts = _prompts(4, seed=9)
    loras = [ads[0], None, ads[1], None]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [
        llm.generate([p], params, lora_request=[lr])[0].outputs[0].token_ids for p, lr in zip(prompts, loras)
    ]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
    assert together == alone
    base = llm.generate([prompts[0]], params)[0].outputs[0].token_ids
    assert alone[0] != base
    assert llm.engine.kv.num_used_blocks == 0
