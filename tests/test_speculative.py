"""Speculative decoding end to end: with a proposer on, greedy output equals plain greedy token for
token, in batches that mix speculating rows, rows that opted out, prefill chunks, stop strings, stop
tokens, logprobs and penalties; seeded sampling is reproducible; the KV pool ends idle after many
speculating requests with cancellations. Tiny random Llama/Qwen3 models (load_format dummy, the
synthetic tokenizer: every id decodes to " t<id>") and, marked slow, the real SmolLM2."""

from __future__ import annotations

import random

import pytest
import torch

from foveal import SamplingParams
from foveal.config import SpeculativeConfig

NGRAM = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
    "adaptive": False,  # every row drafts whenever it can: these tests are about verification
}  # fmt: skip


# greedy rows that mix what verification must respect: an opted-out row, logprobs, a penalty, a length
# stop inside a verify run, min_tokens
MIXED_GREEDY = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, speculative=False),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2),
    SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=4),
]


_ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


@pytest.fixture(scope="module", params=list(_ARCHS))
def folder(request, tmp_path_factory):
    from tests.tiny import tiny_config

    cfg = tiny_config(request.param)
    cfg.architectures = [_ARCHS[request.param]]
    path = tmp_path_factory.mktemp("spec") / "tiny.json"
    path.write_text(cfg.to_json_string())
    return path


def _llm(folder, spec=None, **kw):
    from foveal.engine.llm import LLM

    opts = dict(dtype="float32", num_blocks=160, block_size=4, max_num_seqs=8, max_model_len=160)
    return LLM(str(folder), load_format="dummy", speculative_config=spec, **{**opts, **kw})


def _prompts(n=6, seed=0):
    """Prompts that repeat themselves (so the n-gram lookup finds matches) and random ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        piece = torch.randint(3, 250, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
        out.append(piece * 4 if i % 2 == 0 else torch.randint(3, 250, (20,), generator=g).tolist())
    return out


def _run(llm, prompts, params):
    outs = llm.generate(prompts, params)
    eng = llm.engine
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished()
    assert eng.runner.num_held == 0  # the runner forgot every finished request
    return [
        (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].logprobs)
        for o in outs
    ]


def _same(folder, prompts, params, **kw):
    plain = _run(_llm(folder, **kw), prompts, params)
    spec_llm = _llm(folder, NGRAM, **kw)
    spec = _run(spec_llm, prompts, params)
    for a, b in zip(spec, plain):
        assert a[:3] == b[:3]
        if b[3] is not None:  # logprobs of the accepted tokens come from the target: the same values
            assert [x.token_id for x in a[3]] == [x.token_id for x in b[3]]
            torch.testing.assert_close(
                torch.tensor([x.logprob for x in a[3]]),
                torch.tensor([x.logprob for x in b[3]]),
                atol=1e-4,
                rtol=0,
            )
    return spec_llm.engine.speculation.stats


def test_greedy_equals_plain_greedy_and_drafts_are_accepted(folder):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    stats = _same(folder, _prompts(), params)
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0  # speculation actually happened


def test_mixed_batch_opt_out_stops_logprobs_penalties_chunks(folder):
    prompts = _prompts(8, seed=1)
    plain = _llm(folder).generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    # a stop string and a stop token taken from the middle of plain outputs: they fall inside runs
    stop_text = plain[0].outputs[0].text.split()[12]
    stop_tok = plain[2].outputs[0].token_ids[9]
    params = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_text]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=False),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.5, presence_penalty=0.3
        ),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, min_tokens=5),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={7: 3.0}),
    ]
    # a small budget: prompts arrive in chunks that share steps with verify rows
    stats = _same(folder, prompts, params, max_num_batched_tokens=12)
    assert stats.num_accepted_tokens > 0


class _DeviceOracle:
    """Drafts computed "on the device" (propose_device): each row's recorded continuation, every
    third proposal's last draft made wrong (so staged drafts are rejected too)."""

    tap = None
    num_speculative_tokens = 3

    def __init__(self, refs: dict[tuple, list[int]]):
        self.refs, self.calls = refs, 0

    def propose_device(self, rows):
        flat, counts = [], []
        for row in rows:
            full = next(f for p, f in self.refs.items() if tuple(row.token_ids[: len(p)]) == p)
            d = full[len(row.token_ids) : len(row.token_ids) + min(row.max_drafts, 3)]
            self.calls += 1
            if d and self.calls % 3 == 0:
                d[-1] = (d[-1] + 1) % 250
            flat += d
            counts.append(len(d))
        return torch.tensor(flat, dtype=torch.long), counts

    def accepted(self, request_id, num_drafts, num_accepted):
        pass

    def finish(self, request_id):
        pass


def test_drafts_left_on_the_device_are_verified_as_their_ids(folder):
    """A proposer's device drafts are staged in the runner's token buffer unread (placeholders in the
    scheduled items) and verified from there; rows whose sampling reads the drafts (penalties) get
    them as ids. Correct drafts are accepted, wrong ones rejected, output equals plain greedy."""
    from foveal.sched.batch import DEVICE_DRAFT

    prompts = _prompts(6, seed=4)
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
    ] * 2
    plain = _run(_llm(folder), prompts, params)
    llm = _llm(folder, NGRAM, max_num_batched_tokens=12)
    eng = llm.engine
    oracle = _DeviceOracle({tuple(p): p + list(o[0]) for p, o in zip(prompts, plain)})
    eng.speculation.proposer = oracle
    seen = {"staged": 0, "ids": 0}
    launch = eng.runner.launch

    def counting(batch, **kw):
        for s in batch.items:
            if s.num_drafts:
                seen["staged" if s.drafts[0] == DEVICE_DRAFT else "ids"] += 1
        return launch(batch, **kw)

    eng.runner.launch = counting
    spec = _run(llm, prompts, params)
    for a, b in zip(spec, plain):
        assert a[:3] == b[:3]
        if b[3] is not None:
            assert [x.token_id for x in a[3]] == [x.token_id for x in b[3]]
    st = eng.speculation.stats
    assert seen["staged"] > 0 and seen["ids"] > 0 and oracle.calls > 0
    # every proposal is right but every third one's last draft: most drafts are accepted
    assert st.num_accepted_tokens >= st.num_draft_tokens // 2 > 0


def test_seeded_sampling_is_reproducible_with_speculation(folder):
    prompts = _prompts(4, seed=2)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, ignore_eos=True, seed=100 + i)
        for i in range(4)
    ]
    a = _run(_llm(folder, NGRAM), prompts, params)
    b = _run(_llm(folder, NGRAM), prompts[:1], params[:1])  # alone, not in a batch
    c = _run(_llm(folder, NGRAM), prompts, params)
    assert a == c and a[0] == b[0]


def test_pool_idle_after_many_speculating_requests_with_cancellations(folder):
    llm = _llm(folder, NGRAM, max_num_seqs=16)
    eng = llm.engine
    rng = random.Random(0)
    prompts = _prompts(8, seed=3)
    live: list[str] = []
    done = 0
    submitted = 0
    while done < 1000:
        while submitted < 1000 and len(live) < 24:
            params = SamplingParams(
                temperature=rng.choice([0, 0.7]), max_tokens=rng.randint(1, 12), ignore_eos=True
            )
            live.append(eng.add_request(llm.processor.request(rng.choice(prompts), params)))
            submitted += 1
        if rng.random() < 0.3:
            eng.abort(live[rng.randrange(len(live))])
        for d in eng.step():
            if d.finished:
                live.remove(d.request_id)
                done += 1
    assert not eng.has_unfinished()
    eng.kv.check_integrity()
    assert eng.kv.num_used_blocks == 0 and eng.runner.num_held == 0
    assert eng.speculation.stats.num_drafts > 0


def test_speculative_config_validation():
    cfg = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg.num_speculative_tokens == 3 and cfg.prompt_lookup_max == 4
    for bad, msg in [
        ('{"method": "medusa"}', "unknown speculative method"),
        ('{"num_speculative_tokens": 2}', "needs a method"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"method": "ngram", "k": 2}', "unknown speculative config key"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ("not json", "not valid JSON"),
    ]:
        with pytest.raises(ValueError, match=msg):
            SpeculativeConfig.parse(bad)


@pytest.mark.slow
def test_real_model_greedy_equals_plain(llm_fp32):
    from foveal.engine.llm import LLM

    prompts = [
        "Repeat this text exactly: The quick brown fox jumps over the lazy dog near the river bank. Repeat:",
        "def add(a, b):\n    return a + b\n\n# the same function, renamed to plus:\n",
        "Hello, my name is",
    ]
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in llm_fp32.generate(prompts, params)]
    spec = LLM(dtype="float32", quantization="none", kv_cache_memory=256 * 2**20, speculative_config=NGRAM)
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == plain
    assert spec.engine.speculation.stats.num_accepted_tokens > 10


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two tiny Llama checkpoints on disk: the target and a different (differently seeded) draft."""
    from tests.test_loader import tiny_hf_tokenizer, tiny_model

    out = {}
    for name, seed in (("target", 0), ("draft", 1)):
        folder = tmp_path_factory.mktemp(name)
        tiny_model("llama", seed=seed).save_pretrained(folder)
        tiny_hf_tokenizer().save_pretrained(folder)
        out[name] = str(folder)
    return out


def _draft_llm(saved, draft: str | None, **kw):
    from foveal.engine.llm import LLM

    spec = (
        None
        if draft is None
        else {"method": "draft_model", "model": saved[draft], "num_speculative_tokens": 3, "adaptive": False}
    )
    opts = dict(dtype="float32", num_blocks=160, block_size=4, max_num_seqs=8, max_model_len=160)
    return LLM(saved["target"], speculative_config=spec, **{**opts, **kw})


def test_draft_model_equal_to_target_accepts_every_draft(saved):
    prompts = _prompts(5, seed=4)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    # a small budget staggers the prompts: one step's draft batch mixes catch-up chunks and decodes
    plain = _run(_draft_llm(saved, None, max_num_batched_tokens=16), prompts, params)
    llm = _draft_llm(saved, "target", max_num_batched_tokens=16)
    assert _run(llm, prompts, params) == plain
    st = llm.engine.speculation.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens  # 100% at temperature 0
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0  # the draft's pool is idle too


def test_draft_model_greedy_is_lossless_in_mixed_batches(saved):
    prompts = _prompts(6, seed=5)
    params = MIXED_GREEDY
    plain = _run(_draft_llm(saved, None, max_num_batched_tokens=10), prompts, params)
    llm = _draft_llm(saved, "draft", max_num_batched_tokens=10)
    got = _run(llm, prompts, params)
    assert [g[:3] for g in got] == [p[:3] for p in plain]
    st = llm.engine.speculation.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens < st.num_draft_tokens  # a different model: rejections
    assert llm.engine.speculation.proposer.kv.num_used_blocks == 0


def test_draft_proposer_batches_catch_up_chunks_and_decodes_alike(saved):
    """One propose() call that mixes a fresh prompt (a long catch-up chunk) with a row that has one
    unseen token proposes what each row gets alone (the draft batch keeps decodes first)."""
    from foveal.speculative.proposer import ProposeRow

    def fresh():
        return _draft_llm(saved, "target").engine.speculation.proposer

    a, b = list(range(3, 20)), list(range(40, 50))
    alone = fresh()
    alone.propose([ProposeRow("b", b, 3)])
    want_b = alone.propose([ProposeRow("b", b + [77], 3)])[0]  # one unseen token: a decode item
    want_a = fresh().propose([ProposeRow("a", a, 3)])[0]
    mixed = fresh()
    mixed.propose([ProposeRow("b", b, 3)])
    got = mixed.propose([ProposeRow("a", a, 3), ProposeRow("b", b + [77], 3)])
    assert got == [want_a, want_b] and len(want_a) == 3
