"""Closing a constrained answer before max_tokens (foveal/structured/closing.py): the JSON nesting
reader, plans from random points of held-out schemas that complete to documents jsonschema accepts,
the cases a greedy closer cannot do alone (a pattern's literal, an anchored pattern mid-string, a
character cut in half, a number that may not be 0), and through the engine: an answer that would run
past max_tokens ends complete with finish_reason "length", also from inside a think block, and
`close_on_length=False` keeps the plain cut."""

from __future__ import annotations

import json
import random
import tempfile
import time

import pytest
import torch

from foveal import SamplingParams
from foveal.request import FinishReason
from foveal.structured import OutputConstraint
from tests.heldout import HELDOUT

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MASKBENCH = HELDOUT / "jsonschemabench" / "maskbench_sample.jsonl"


@pytest.fixture
def unbudgeted(monkeypatch):
    """The search's own reach, without the model thread's budget (closing.Budget) that serving gives
    it: what these tests check is what it finds."""
    from foveal.structured import closing

    monkeypatch.setattr(closing, "BUDGET", closing.Budget(60.0, 10**9, 60.0))
    monkeypatch.setattr(closing, "WITNESS_SECONDS", 60.0)


@pytest.fixture(scope="module")
def backend():
    from foveal.structured.llguidance_backend import LLGuidanceBackend
    from tests.tiny_vlm import byte_tokenizer

    return LLGuidanceBackend.from_tokenizer(byte_tokenizer([], ""))


def plan_from(backend, spec: OutputConstraint, prefix: bytes, limit: int = 4000):
    """(the matcher after `prefix`, the plan from there), with the nesting read from the prefix."""
    from foveal.structured.closing import nesting, prepare

    g = backend.compile(spec)
    m = g.matcher()
    assert m.accept(backend.tokenize_bytes(prefix)), prefix
    return m, prepare(g).plan(m, nesting("", prefix), limit)


def finish(backend, spec, prefix: bytes, limit: int = 4000) -> str:
    m, plan = plan_from(backend, spec, prefix, limit)
    assert plan is not None, prefix
    assert m.accept(plan) and m.is_accepting()
    return (prefix + backend.token_bytes(plan)).decode()


def test_nesting_reads_strings_escapes_and_containers():
    from foveal.structured.closing import nesting

    assert nesting("", b'{"a": [1, {"b": "x') == '{[{"'
    assert nesting("", b'{"a": "]}\\"[{') == '{"'  # brackets and an escaped quote inside a string
    assert nesting("", b'{"a": "x\\') == '{"\\'  # an escape pending
    assert nesting('{"\\', b'n", "b": []}') == ""
    assert nesting("", b'[[], {}, ""]') == ""


def test_cases_a_greedy_closer_cannot_do_alone(backend, unbudgeted):
    # a pattern with search semantics: its literal anywhere lets the string close
    s = {"type": "object", "properties": {"img": {"type": "string", "pattern": "data:image/png;base64,"}},
         "required": ["img"]}  # fmt: skip
    spec = OutputConstraint.json_schema(s)
    out = finish(backend, spec, b'{"img": "abc\xc3')  # ...and a character cut in half first
    jsonschema.validate(json.loads(out), s)
    assert "data:image/png;base64," in out
    # an anchored pattern, mid-string: its groups allow the same next bytes, the search tells them apart
    part = "[a-zA-Z0-9-_]+"
    s = {"type": "string", "pattern": f"^iglu:[a-zA-Z0-9-_.]+/{part}/{part}/[0-9]+-[0-9]+-[0-9]+$"}
    out = finish(backend, OutputConstraint.json_schema(s), b'"iglu:com.acme/')
    jsonschema.validate(json.loads(out), s)
    # a number that may not be 0, a required key after it, an array with minItems
    x = {"type": "number", "exclusiveMinimum": 0}
    y = {"type": "array", "items": {"type": "integer"}, "minItems": 3}
    s = {"type": "object", "required": ["x", "y"], "properties": {"x": x, "y": y}}
    out = finish(backend, OutputConstraint.json_schema(s), b'{"x": 0.')
    jsonschema.validate(json.loads(out), s)
    # other kinds of grammar: a regex, a choice, a Lark grammar
    import re

    assert re.fullmatch(r"12\.\d\.\d", finish(backend, OutputConstraint.regex(r"\d+\.\d+\.\d+"), b"12"))
    assert finish(backend, OutputConstraint.choice(["alpha", "beta"]), b"al") == "alpha"
    lark = OutputConstraint.lark('start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/')
    assert finish(backend, lark, b"(12,") in ("(12,0)", "(12,9)")
    # no room: no plan
    assert plan_from(backend, OutputConstraint.json_schema(s), b'{"x": 0.', limit=5)[1] is None


def random_point(backend, grammar, seed: int, steps: int):
    """(a matcher, its tokens) after `steps` one-byte tokens drawn under the grammar's mask, three times
    likelier `"`, `]` and `}` (as the end-to-end test's requests are biased); shorter where the
    grammar ends. Shared with benchmarks/closing.py."""
    rng, m, out = random.Random(seed), grammar.matcher(), []
    row = torch.zeros(grammar.words, dtype=torch.int32)
    for _ in range(steps):
        m.fill_bitmask(row)
        allowed = [t for t in backend.byte_tokens.values() if (int(row[t // 32]) >> (t % 32)) & 1]
        if not allowed:
            break
        weight = [3 if backend.token_bytes([t]) in (b'"', b"]", b"}") else 1 for t in allowed]
        out.append(rng.choices(allowed, weight)[0])
        assert m.accept(out[-1:])
    return m, out


def accepted_schemas(backend, every: int):
    """(row, compiled grammar) for every `every`-th maskbench schema the backend accepts."""
    for r in [json.loads(line) for line in MASKBENCH.read_text().splitlines()][::every]:
        try:
            yield r, backend.compile(OutputConstraint.json_schema(r["schema"]))
        except ValueError:
            continue


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/heldout is not here")
def test_plans_from_random_points_of_maskbench_schemas_validate(backend, unbudgeted):
    """Every 5th accepted schema, three random walks under its mask (5, 30, 300 one-byte tokens, biased
    towards closers as the end-to-end test is): the plan from each point completes a document that
    jsonschema accepts, within the budget."""
    from foveal.structured.closing import nesting, prepare

    tried = 0
    for r, g in accepted_schemas(backend, 5):
        for seed, steps in enumerate((5, 30, 300)):
            m, out = random_point(backend, g, seed, steps)
            plan = prepare(g).plan(m, nesting("", backend.token_bytes(out)), 8000)
            assert plan is not None and len(plan) <= 8000, (r["id"], backend.token_bytes(out)[-80:])
            assert m.accept(plan) and m.is_accepting()
            jsonschema.validate(json.loads(backend.token_bytes(out + plan)), r["schema"])
            tried += 1
    assert tried >= 240


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/heldout is not here")
def test_a_states_probes_read_from_its_mask_equal_its_validates(backend):
    """The search reads a state's one-byte probes from one mask or by a validate per byte (closing._Bits,
    whichever is cheaper on the grammar): the same bits wherever nothing is forced (every 10th accepted
    schema, random points of 5, 30 and 300 tokens, both alphabets)."""
    from foveal.structured import closing
    from foveal.structured.bitmask import bitmask_words

    byte = backend.byte_tokens
    readers = [
        closing._Bits(bitmask_words(backend.vocab_size), [byte[b] for b in closing._PROBE if b in byte],
                      [byte[b] for b in alphabet if b in byte], [0, 0.0, 0.0], closing.Budget())
        for alphabet in (closing._STRING, closing._VALUE)
    ]  # fmt: skip
    read = 0
    for r, g in accepted_schemas(backend, 10):
        for seed, steps in enumerate((5, 30, 300)):
            m, _ = random_point(backend, g, seed, steps)
            if m.forced():
                continue
            for bits in readers:
                masked = bits._masked(m)
                assert masked == bits._validated(m), r["id"]
                read += sum(masked) > 0
    assert read >= 40


def test_the_search_keeps_the_cheaper_way_to_read_probes(monkeypatch):
    """After TRIALS states read both ways, the search reads the rest the way that cost less."""
    from foveal.structured import closing

    ticks = iter(range(10**6))
    monkeypatch.setattr(closing.time, "perf_counter", lambda: next(ticks))
    calls = []

    class M:
        def validate(self, tokens):
            calls.append("v")
            return 1

        def fill_bitmask(self, row):
            calls.append("m")
            row.fill_(-1)

    for slow, cheap in (("m", "v"), ("v", "m")):
        bits = closing._Bits(1, [1, 2], [3], [0, 0.0, 0.0], closing.Budget())
        real = getattr(bits, "_masked" if slow == "m" else "_validated")
        monkeypatch.setattr(bits, "_masked" if slow == "m" else "_validated",
                            lambda m, real=real: [next(ticks) for _ in range(50)] and real(m))  # fmt: skip
        for _ in range(bits.TRIALS):
            assert bits.read(M()) == ((1, 1), (1,))
        calls.clear()
        assert bits.read(M()) == ((1, 1), (1,)) and set(calls) == {cheap}, (slow, calls)


# -- through the engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import save_tiny_text_model

    path = save_tiny_text_model(tempfile.mkdtemp())
    return LLM(path, dtype="float32", num_blocks=1024, block_size=16, max_num_seqs=16, max_model_len=1024)


IMAGE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string", "pattern": "data:image/png;base64,"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["name", "image", "tags"],
}


def test_a_plans_budget_counts_its_threads_cpu_time_not_waiting():
    """A plan waiting for the GIL or a core is not over its budget; one computing for as long is."""
    from foveal.structured import closing

    b = closing.Budget(plan_s=0.02, step_s=0.02)
    assert b.start()
    time.sleep(0.05)  # another thread holds the core: wall time passes, this thread's CPU time does not
    b.spend()
    b.check()
    b.end(skipped=False)
    assert b.start()
    t = time.thread_time()
    while time.thread_time() - t < 0.03:  # computing (counted on the thread's clock: a loaded host too)
        pass
    with pytest.raises(closing._OverBudget):
        b.spend()
    b.end(skipped=True)
    assert b.skipped == 1 and b.step_spent >= 0.02


def test_a_plan_stopped_by_the_steps_time_left_is_put_off_not_given_up(backend, monkeypatch):
    """The step's other plans took most of its budget: a plan stopped at what they left (short of its
    own limit) is asked again at the next step (DEFER), not given up; stopped at its own time limit, or
    at its expansions however much time was left, it is given up (None, counted)."""
    from foveal.structured import closing

    b = closing.Budget(plan_s=0.02, step_s=0.02)
    monkeypatch.setattr(closing, "BUDGET", b)
    g = backend.compile(
        OutputConstraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}})
    )
    m = g.matcher()
    assert m.accept(backend.tokenize_bytes(b'{"a": "x'))  # mid-answer
    closer = closing.closer_for(g)
    cpu_bound = [True]

    def search(*a):  # a search that never ends, by CPU time or by matcher copies
        while True:
            b.check() if cpu_bound[0] else b.spend()

    monkeypatch.setattr(closer, "_plan", search)
    b.step_spent = 0.015  # the step's earlier plans: 5 ms of its 20 left
    assert closer.plan(m, '{"', 64) is closing.DEFER and b.skipped == 0
    b.new_step()
    assert closer.plan(m, '{"', 64) is None and b.skipped == 1  # its own 20 ms
    b.step_spent, cpu_bound[0] = 0.015, False
    assert closer.plan(m, '{"', 64) is None and b.skipped == 2  # its expansions, within the 5 ms left


def test_the_plan_from_the_start_is_made_in_the_input_pool(backend, monkeypatch):
    """prepare(grammar, max_tokens) plans from the grammar's start off the model thread's step budget;
    a request's first look then reads it (found, or given up) without a plan on the model thread."""
    from foveal.structured import closing

    monkeypatch.setattr(closing, "BUDGET", closing.Budget())
    short = backend.compile(
        OutputConstraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    )
    long = backend.compile(
        OutputConstraint.json_schema({"type": "array", "minItems": 1000, "items": {"type": "string"}})
    )
    for g in (short, long):
        closing.prepare(g, 64)
    assert closing.BUDGET.step_spent == 0  # none of it counted against a step

    def on_the_model_thread(*a, **k):
        raise AssertionError("a plan ran on the model thread")

    monkeypatch.setattr(closing.Closer, "_budgeted", on_the_model_thread)
    plan = closing.closer_for(short).plan(short.matcher(), "", 64)
    m = short.matcher()
    assert plan is not None and m.accept(plan) and m.is_accepting()
    assert closing.closer_for(long).plan(long.matcher(), "", 64) is None  # 1,000 items never fit 64


def test_an_answer_past_max_tokens_ends_complete_with_length(tiny, monkeypatch):
    """A random model writes strings that never close (the image's pattern needs a literal it does not
    write); at max_tokens the answer still parses and validates, finish_reason "length", within the
    budget's expansions (its time limits set wide: a slower host must not cut a plan). With
    close_on_length=False it is cut where it falls (not JSON)."""
    from foveal.structured import closing
    from tests.test_structured_outputs import assert_idle, closing_bias

    monkeypatch.setattr(closing, "BUDGET", closing.Budget(plan_s=10.0, step_s=10.0))

    spec = OutputConstraint.json_schema(IMAGE)
    for max_tokens in (60, 150):
        params = [
            SamplingParams(
                temperature=1.0,
                seed=s,
                max_tokens=max_tokens,
                structured=spec,
                logit_bias=closing_bias(tiny, 2),
            )  # fmt: skip
            for s in range(6)
        ]
        for o in tiny.generate(["{"] * 6, params):
            c = o.outputs[0]
            assert len(c.token_ids) <= max_tokens
            jsonschema.validate(json.loads(c.text), IMAGE)
            assert c.finish_reason is FinishReason.LENGTH, c.text
    assert tiny.engine.guides.closed_answers >= 12
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=60, structured=spec, close_on_length=False)
    (o,) = tiny.generate(["{"], p)
    c = o.outputs[0]
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) == 60
    with pytest.raises(ValueError):
        json.loads(c.text)
    assert_idle(tiny)


def test_a_budget_spent_thinking_ends_the_thought_then_the_answer():
    """No thinking budget, and the random thinker never closes its block: near max_tokens the end
    marker is forced, then the shortest answer; the answer after </think> validates."""
    from foveal.engine.llm import LLM
    from tests.test_structured_outputs import save_thinker

    llm = LLM(save_thinker(tempfile.mkdtemp()), dtype="float32", num_blocks=512, block_size=16,
              reasoning_parser="qwen3")  # fmt: skip
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    end = llm.tokenizer.get_vocab()["</think>"]
    p = SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True,
                       structured=OutputConstraint.json_schema(schema))  # fmt: skip
    (c,) = llm.chat([{"role": "user", "content": "hi"}], p)[0].outputs
    assert c.finish_reason is FinishReason.LENGTH and len(c.token_ids) <= 40
    assert end in c.token_ids
    answer = llm.tokenizer.decode(c.token_ids[c.token_ids.index(end) + 1 :])
    jsonschema.validate(json.loads(answer), schema)
