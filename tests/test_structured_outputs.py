"""Structured outputs end to end, through the engine: every maskbench schema the backend accepts gives
JSON that validates (temperature 1, a tiny random model), regex / choice / Lark outputs match in full,
constrained and free rows share a batch, speculation keeps greedy output equal, a failing grammar ends
its request alone, and the think block: the grammar starts after it, and the budget ends it after
exactly N thinking tokens.

The tiny models are random Llamas over a byte tokenizer (one token per byte). A random model's
strings and arrays rarely end, so requests carry a logit_bias towards `"`, `]` and `}` (an ordinary
request parameter); the grammar decides what is valid, the bias only how soon it ends.
"""

from __future__ import annotations

import json
import pathlib
import tempfile

import pytest
import torch

from foveal import SamplingParams
from foveal.request import FinishReason
from foveal.structured import OutputConstraint, closing
from tests.heldout import HELDOUT

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MASKBENCH = HELDOUT / "jsonschemabench" / "maskbench_sample.jsonl"
MASKBENCH_TOKENS = 2000  # max_tokens: the schemas whose shortest document fits (all but 6 of the 435)
LONGEST = 6000  # the longest shortest document of an accepted schema is 5,628 bytes
PROPOSERS = ("ngram", "draft_model", "eagle3", "mtp", "dflash")
# compiled grammars an engine of the corpus test keeps: the whole sample (the default's 256 LRU entries,
# walked in order over 435 schemas three times, compiled each one three times and planned it twice)
CORPUS_GRAMMARS = 1024
_VALIDATORS: dict[str, object] = {}  # maskbench id -> its schema's checked jsonschema validator


def validate(instance, row: dict) -> None:
    """jsonschema.validate(instance, row["schema"]), its schema checked against its meta-schema once per
    session: jsonschema.validate checks it on every call (~17 ms a schema here), so every proposer's
    run checked its fifth of the schemas again."""
    v = _VALIDATORS.get(row["id"])
    if v is None:
        cls = jsonschema.validators.validator_for(row["schema"])
        cls.check_schema(row["schema"])
        v = _VALIDATORS[row["id"]] = cls(row["schema"])
    error = jsonschema.exceptions.best_match(v.iter_errors(instance))
    if error is not None:
        raise error


@pytest.fixture(scope="module")
def tiny():
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import save_tiny_text_model

    path = save_tiny_text_model(tempfile.mkdtemp())
    return LLM(
        path, dtype="float32", num_blocks=8192, block_size=16, max_num_seqs=64, max_model_len=12288,
        grammar_cache_entries=CORPUS_GRAMMARS,
    )  # fmt: skip


def assert_idle(llm) -> None:
    """Nothing left behind: no block, no guided request counted by the engine or the runner."""
    eng = llm.engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished()
    assert eng._num_host_readers == 0 and eng.guides.num_guided == 0


@pytest.fixture(autouse=True)
def _unbudgeted(monkeypatch):
    """These tests check what the closing search finds on random-byte answers, whose plans take up to
    seconds; the model thread's budget for them (closing.Budget, tested in test_structured.py and
    test_adversarial.py) would give some up."""
    monkeypatch.setattr(closing, "BUDGET", closing.Budget(60.0, 10**9, 60.0))
    monkeypatch.setattr(closing, "WITNESS_SECONDS", 60.0)


def closing_bias_ids(tokenizer, value: int = 4) -> dict[int, int]:
    """Towards the bytes that close strings, arrays and objects; away from whitespace (a flexible-
    whitespace grammar allows any amount of it, and a random model takes it)."""
    enc = tokenizer.encode
    bias = {t: value for c in '"]}' for t in enc(c, add_special_tokens=False)}
    bias.update({t: -value for c in " \t\r\n" for t in enc(c, add_special_tokens=False)})
    return bias


def closing_bias(llm, value: int = 4) -> dict[int, int]:
    return closing_bias_ids(llm.tokenizer, value)


def spec_config(proposer: str, path: str) -> dict:
    """A speculative config that drafts on every step it can (these tests are about the composition)."""
    if proposer == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                "prompt_lookup_min": 1, "adaptive": False}  # fmt: skip
    if proposer == "draft_model":
        return {"method": "draft_model", "model": path, "num_speculative_tokens": 3, "adaptive": False}
    # a random head in its published layout, for the tiny 2-layer target of `path`
    from tests.test_spec_heads import write_dflash, write_eagle3

    vocab = json.loads((pathlib.Path(path) / "config.json").read_text())["vocab_size"]
    folder = pathlib.Path(tempfile.mkdtemp())
    if proposer == "eagle3":  # the embeddings, layer 1's input and the last layer's output
        head = write_eagle3(folder, vocab=vocab, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    else:
        head = write_dflash(folder, vocab=vocab, target_layers=[0, 1], num_target_layers=2)
    return {"method": proposer, "model": head, "num_speculative_tokens": 3, "adaptive": False}


def mimo_like(llm) -> str:
    """A tiny MiMo checkpoint (a Qwen2 decoder with an MTP layer) whose decoder is `llm`'s tiny Llama
    (zero q/k/v biases: the same model), with its tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tests.test_spec_heads import HD, HEADS, KV, _mtp_tensors

    src = pathlib.Path(llm.engine.config.model.model)
    folder = pathlib.Path(tempfile.mkdtemp())
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, folder / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        for name, rows in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            tensors[f"model.layers.{i}.self_attn.{name}_proj.bias"] = torch.zeros(rows)
    tensors.update(_mtp_tensors(3))
    save_file(tensors, str(folder / "model.safetensors"))
    return str(folder)


@pytest.fixture(scope="module", params=[None, "ngram", "draft_model", "eagle3", "mtp", "dflash"])
def corpus_llm(request, tiny):
    """The tiny model plain, with n-gram speculation, with itself as the draft model, with random
    EAGLE-3 and DFlash heads; a tiny MiMo with its MTP layer."""
    if request.param is None:
        return tiny
    from foveal.engine.llm import LLM

    path = tiny.engine.config.model.model
    if request.param == "mtp":
        mtp = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": False}
        llm = LLM(
            mimo_like(tiny), dtype="float32", num_blocks=8192, block_size=16, max_num_seqs=64,
            max_model_len=12288, speculative_config=mtp, grammar_cache_entries=CORPUS_GRAMMARS,
        )  # fmt: skip
    else:
        llm = LLM(
            path, dtype="float32", num_blocks=8192, block_size=16, max_num_seqs=64, max_model_len=12288,
            speculative_config=spec_config(request.param, path), grammar_cache_entries=CORPUS_GRAMMARS,
        )  # fmt: skip
    return share_grammars(llm, tiny)


def share_grammars(llm, tiny):
    """`llm` compiles through `tiny`'s grammar cache: the same tokenizer and vocabulary (asserted), so
    the same grammars; each is compiled, and its closing plan from the start (kept by its closing.Closer)
    made, once for all the corpus's engines, not once per engine."""
    mine, theirs = llm.processor, tiny.processor
    assert mine.mask_vocab == theirs.mask_vocab and mine.info.eos_token_ids == theirs.info.eos_token_ids
    assert mine.tokenizer.get_vocab() == theirs.tokenizer.get_vocab()
    assert mine.grammar_stats() is None  # nothing compiled through its own cache yet
    mine._grammars = theirs.grammars
    return llm


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/heldout is not here")
def test_every_accepted_maskbench_schema_gives_valid_json(corpus_llm, request):
    """All accepted schemas of the held-out sample in one batch, sampled at temperature 1: every output
    parses and validates with jsonschema; the refused schemas are 400-worthy ValueErrors, counted.
    Plain, and with each proposer drafting on every step (a draft the grammar forbids ends its row's
    accepted run). An output that would run past max_tokens is closed by its grammar's completion
    (closing.py: finish_reason "length"); some schemas need it, a `pattern` whose literal (search
    semantics: "data:image/png;base64,") a random byte stream never writes. The closing search runs
    without its budget here (`_unbudgeted`): random-byte answers need plans of up to seconds, which
    the model thread's budget gives up (benchmarks/closing.py counts how many).
    For time: the plain run takes every schema, each proposer a fifth of them (the five together
    cover each schema once); the 6 schemas whose shortest document is longer than max_tokens (2,590 to
    5,628 tokens: thousands of steps at a batch of one) are not generated: the document their closing
    plan writes from the start is validated instead (what a request of theirs is closed to)."""
    tiny = corpus_llm
    rows = [json.loads(line) for line in MASKBENCH.read_text().splitlines()]
    proc = tiny.processor
    accepted, refused = [], 0
    for r in rows:
        spec = OutputConstraint.json_schema(r["schema"])
        try:
            proc.grammars.get(spec)
        except ValueError:
            refused += 1
            continue
        accepted.append((r, spec))
    print(f"maskbench: {len(accepted)} schemas accepted, {refused} refused of {len(rows)}")
    assert len(accepted) >= 400
    if tiny.engine.speculation is not None:
        accepted = accepted[PROPOSERS.index(request.node.callspec.params["corpus_llm"]) :: 5]
    fits, long = [], []
    for r, spec in accepted:
        g = proc.grammars.get(spec)
        plan = closing.prepare(g).plan(g.matcher(), "", LONGEST)  # what the request's admission plans
        assert plan is not None, r["id"]
        if len(plan) <= MASKBENCH_TOKENS:
            fits.append((r, spec))
        else:
            validate(json.loads(closing.prepare(g).text(plan)), r)
            long.append(r["id"])
    assert len(long) <= 6, long
    bias = closing_bias(tiny)
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MASKBENCH_TOKENS, structured=spec, logit_bias=bias)
        for i, (_, spec) in enumerate(fits)
    ]
    outs = tiny.generate(["{"] * len(fits), params)
    bad, closed = [], []
    for (r, _), o in zip(fits, outs):
        c = o.outputs[0]
        try:
            assert c.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), c.finish_reason
            validate(json.loads(c.text), r)
        except Exception as e:  # collect them all: the message lists every schema that failed
            bad.append((r["id"], f"{type(e).__name__}: {str(e)[:120]}", c.text[-80:]))
        if c.finish_reason is FinishReason.LENGTH:
            closed.append(r["id"])
    longest = max(len(o.outputs[0].token_ids) for o in outs)
    print(f"maskbench: all {len(fits)} outputs end (longest {longest} tokens); {len(closed)} closed for "
          f"max_tokens: {closed}; not generated (their closing plans validate): {long}")  # fmt: skip
    assert not bad, f"{len(bad)} of {len(fits)} outputs invalid: {bad[:5]}"
    assert_idle(tiny)
    if tiny.engine.speculation is not None:
        assert tiny.engine.speculation.stats.num_draft_tokens > 0


def test_regex_choice_and_lark_match_in_full(tiny):
    cases = [
        # [0-9], not \d: llguidance's \d takes every Unicode digit of its Unicode version (16: the
        # outlined digits U+1CCF0..), which Python 3.11's re does not know
        (OutputConstraint.regex(r"[a-c]{3}-[0-9]{2}"), r"[a-c]{3}-[0-9]{2}"),
        (OutputConstraint.choice(["yes", "no", "maybe so"]), r"yes|no|maybe so"),
        (
            OutputConstraint.lark('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/'),
            r"\(\d{1,3}(,\d{1,3})*\)",
        ),
    ]
    import re

    for spec, pattern in cases:
        outs = tiny.generate(
            ["x"] * 6,
            [SamplingParams(temperature=1.0, seed=s, max_tokens=64, structured=spec) for s in range(6)],
        )
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason is FinishReason.STOP and re.fullmatch(pattern, c.text), (spec, c.text)


def test_constrained_and_free_rows_share_a_batch(tiny):
    """A batch mixing free rows (greedy and sampled, logprobs, penalties) with constrained ones: the
    free rows give exactly what they give alone; the constrained ones match; n > 1 works."""
    spec = OutputConstraint.regex(r"(ab|cd){2,4}!")
    free = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.3),
    ]
    alone = [o.outputs[0] for o in tiny.generate(["p1", "p2"], free)]
    guided = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=20, structured=spec, logprobs=1)
    outs = tiny.generate(["p1", "p2", "p3"], free + [guided])
    for a, o in zip(alone, outs[:2]):
        assert o.outputs[0].token_ids == a.token_ids
    import re

    assert len(outs[2].outputs) == 3
    for c in outs[2].outputs:
        assert re.fullmatch(r"(ab|cd){2,4}!", c.text) and len(c.logprobs) == len(c.token_ids)


def test_async_scheduling_gives_the_same_guided_outputs():
    """Step N+1's forward pass is launched before step N's tokens reach the host; guided rows sample
    once they have (their masks follow them): outputs equal plain steps, and the deferral happened."""
    from foveal.engine.llm import LLM
    from tests.test_async_scheduling import runner_calls, sampling_deferred
    from tests.tiny_vlm import save_tiny_text_model

    path = save_tiny_text_model(tempfile.mkdtemp())
    kw = dict(dtype="float32", num_blocks=1024, block_size=16)
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 5}
    outs = []
    for overlap in (False, True):
        llm = LLM(path, async_scheduling=overlap, **kw)
        calls = runner_calls(llm)
        params = [
            SamplingParams(temperature=1.0, seed=3, max_tokens=60,
                           structured=OutputConstraint.json_schema(schema), logit_bias=closing_bias(llm)),
            SamplingParams(temperature=0, max_tokens=20, structured=OutputConstraint.regex(r"[a-e]{4,20}")),
            SamplingParams(temperature=0.9, seed=1, max_tokens=15, ignore_eos=True),
        ]  # fmt: skip
        outs.append([o.outputs[0].token_ids for o in llm.generate(["[", "x", "y"], params)])
        assert sampling_deferred(calls) == overlap
    assert outs[0] == outs[1]


def test_a_grammar_applies_to_an_image_request(tmp_path):
    """A VLM's image request, constrained: the grammar's mask covers the text model's vocabulary and
    the image rows do not disturb it."""
    import re

    from foveal.engine.llm import LLM
    from tests.tiny_vlm import build, image

    vlm = build("llava", str(tmp_path))
    llm = LLM(vlm.path, dtype="float32", num_blocks=256, block_size=4)
    prompt = llm.processor.render_prompt(
        f"<|user|>{vlm.image_text}What is this?\n<|assistant|>", images=[image(40, 30, 1)]
    )
    spec = OutputConstraint.regex(r"[a-z]{2,6}( [a-z]{2,6}){1,3}")
    outs = llm.generate(
        [prompt] * 3,
        [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured=spec) for s in range(3)],
    )
    eos = llm.processor.info.eos_token_ids  # the tiny config's EOS (id 2) is also a byte token: cut it
    for o in outs:
        c = o.outputs[0]
        ids = c.token_ids[:-1] if c.token_ids[-1] in eos else c.token_ids
        text = llm.tokenizer.decode(ids)
        assert c.finish_reason is FinishReason.STOP and re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", text)


def test_speculative_greedy_equals_plain_greedy_under_a_grammar():
    """n-gram drafts the grammar forbids are rejected: constrained greedy output is the same with and
    without speculation (plain rows in the same batch too)."""
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import save_tiny_text_model

    path = save_tiny_text_model(tempfile.mkdtemp())
    kw = dict(dtype="float32", num_blocks=1024, block_size=16)
    plain = LLM(path, **kw)
    spec_cfg = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
        "adaptive": False,  # draft on every step: the grammar must cut the accepted runs
    }
    spec = LLM(path, speculative_config=spec_cfg, **kw)
    schema = {"type": "array", "items": {"type": "string", "enum": ["abab", "abba", "baba"]}, "maxItems": 6}
    params = [
        SamplingParams(temperature=0, max_tokens=80, structured=OutputConstraint.json_schema(schema),
                       logit_bias=closing_bias(plain, 2.0)),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]  # fmt: skip
    prompts = ['["abab", "abba", "abab", "abba", "abab", ', "abcabcabcabc"]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    assert got == want
    assert spec.engine.speculation.stats.num_draft_tokens > 0
    json.loads(spec.tokenizer.decode(got[0]))


def test_a_failing_grammar_ends_its_request_alone(tiny, monkeypatch):
    from foveal.structured.guide import Guide

    spec = OutputConstraint.regex(r"[ab]{5,9}")
    real = Guide.accept

    def accept(self, token):
        if self.matcher is not None and self.matcher.num_tokens == 2 and self.spec.grammar.spec == spec:
            self.error = "grammar: injected failure"
            return False
        return real(self, token)

    monkeypatch.setattr(Guide, "accept", accept)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = tiny.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=20, structured=spec), plain])
    bad, good = outs[0].outputs[0], outs[1].outputs[0]
    assert bad.finish_reason is FinishReason.ERROR and "injected failure" in bad.error
    assert good.finish_reason is FinishReason.LENGTH and len(good.token_ids) == 8
    assert good.token_ids == tiny.generate(["b"], plain)[0].outputs[0].token_ids  # as if it ran alone
    assert_idle(tiny)


def test_bad_specs_are_refused_before_admission(tiny):
    for spec in (OutputConstraint.regex("(unclosed"), OutputConstraint.lark("start: foo")):
        with pytest.raises(ValueError, match="invalid"):
            tiny.processor.request([5, 6], SamplingParams(structured=spec))
    assert not tiny.engine.has_unfinished()


# -- the think block -----------------------------------------------------------------------------------
THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is not defined or enable_thinking %}"
    "<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def save_thinker(path: str) -> str:
    """A tiny random Llama whose tokenizer has <think> / </think> tokens and whose template opens the
    think block in the generation prompt (as Qwen3-Thinking and DeepSeek-R1 templates do)."""
    import torch
    import transformers as tf

    from tests.tiny_vlm import byte_tokenizer, text_config_kwargs

    tok = byte_tokenizer(["<think>", "</think>"], "")
    tok.chat_template = THINK_TEMPLATE
    torch.manual_seed(1)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**text_config_kwargs(len(tok)), **ids))
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def thinker():
    from foveal.engine.llm import LLM

    path = save_thinker(tempfile.mkdtemp())
    return LLM(path, dtype="float32", num_blocks=512, block_size=16, reasoning_parser="qwen3")


def test_the_budget_ends_thinking_after_exactly_n_tokens(thinker):
    end = thinker.tokenizer.get_vocab()["</think>"]
    chat = [{"role": "user", "content": "hi"}]
    for budget in (0, 1, 7):  # the forced end comes through a bias against it
        p = SamplingParams(temperature=1.0, seed=budget, max_tokens=30, ignore_eos=True,
                           thinking_budget=budget, logit_bias={end: -100})  # fmt: skip
        (c,) = thinker.chat(chat, p)[0].outputs
        assert end in c.token_ids and c.token_ids.index(end) == budget, (budget, c.token_ids)
    # no budget: nothing forces the end (biased away from it, the random model never picks it itself)
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True, logit_bias={end: -100})
    (c,) = thinker.chat(chat, p)[0].outputs
    assert end not in c.token_ids


def test_a_schema_applies_after_thinking(thinker):
    """Thinking is free text (here: forced to end after 12 tokens); the answer after </think> follows
    the schema and validates. With thinking off (the template closes the block), the answer starts at
    once."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = OutputConstraint.json_schema(schema)
    end = "</think>"
    chat = [{"role": "user", "content": "hi"}]
    # ignore_eos: a random model may sample EOS while thinking; the grammar's completion ends the request
    p = SamplingParams(temperature=1.0, seed=2, max_tokens=200, thinking_budget=12, structured=spec,
                       logit_bias=closing_bias(thinker), ignore_eos=True)  # fmt: skip
    (c,) = thinker.chat(chat, p)[0].outputs
    ids = thinker.tokenizer.get_vocab()
    assert c.token_ids.index(ids[end]) == 12 and c.finish_reason is FinishReason.STOP
    answer = thinker.tokenizer.decode(c.token_ids[13:])
    jsonschema.validate(json.loads(answer), schema)
    (c,) = thinker.chat(chat, p, chat_template_kwargs={"enable_thinking": False})[0].outputs
    jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "eagle3", "dflash"])
def test_thinking_budget_and_schema_with_speculation(thinker, proposer):
    """With drafts on every step the budget still ends thinking after exactly N tokens (the forced
    </think> is a draft boundary), and the schema after it still holds."""
    from foveal.engine.llm import LLM

    path = thinker.engine.config.model.model
    spec = LLM(path, dtype="float32", num_blocks=512, block_size=16, reasoning_parser="qwen3",
               speculative_config=spec_config(proposer, path))  # fmt: skip
    end = spec.tokenizer.get_vocab()["</think>"]
    chat = [{"role": "user", "content": "hi hi hi hi"}]
    for budget in (0, 1, 7, 13):
        p = SamplingParams(
            temperature=1.0, seed=budget, max_tokens=40, ignore_eos=True, thinking_budget=budget
        )
        (c,) = spec.chat(chat, p)[0].outputs
        assert end in c.token_ids and c.token_ids.index(end) == budget, (budget, c.token_ids)
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, thinking_budget=budget)
        (g,) = spec.chat(chat, greedy)[0].outputs
        assert g.token_ids == thinker.chat(chat, greedy)[0].outputs[0].token_ids  # speculation: lossless
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint = OutputConstraint.json_schema(schema)
    p = SamplingParams(temperature=1.0, seed=2, max_tokens=200, thinking_budget=12, ignore_eos=True,
                       structured=constraint, logit_bias=closing_bias(spec))  # fmt: skip
    (c,) = spec.chat(chat, p)[0].outputs
    assert c.token_ids.index(end) == 12 and c.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(spec.tokenizer.decode(c.token_ids[13:])), schema)
    assert spec.engine.speculation.stats.num_draft_tokens > 0
    assert_idle(spec)
