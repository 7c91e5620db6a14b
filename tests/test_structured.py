"""Structured outputs (foveal/structured): request shapes -> OutputConstraint, the llguidance backend against
held-out JSON Schema data, regex / choice / Lark semantics, the constrained sampling loop, rollback,
the grammar cache, and the bitmask kernels (torch, Triton in its interpreter, a plain Python reference).

How an instance is checked against a grammar (`Driver`): the instance is serialized (compactly, and with
`indent=2`; ensure_ascii=False, as a model writes text), tokenized with the model's tokenizer, and fed
to a fresh matcher the way the engine will: before each token, fill the mask and require the token's
bit; then accept it. The text is accepted when every token was allowed and, at the end, the mask
allows EOS. On the way it checks that EOS is allowed exactly when the matcher can terminate, and that
the matcher accepts every token the mask allows. The converse does not hold, by llguidance's design:
where the grammar forces text (the rest of an enum value, say), the mask offers only that text's
canonical first token ('be' of "bearer"), while accept() takes any tokenization ('b'). So the verdict
follows the mask, as generation does.

The held-out data is read from ../shared/heldout (see its README), never copied here; tests skip
without it, as they do without the embedded model's tokenizer or llguidance.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import statistics
import threading
import time

import numpy as np
import pytest
import torch

from foveal.structured import GrammarCache, OutputConstraint, allocate_bitmask, bitmask_words
from foveal.structured.bitmask import apply_bitmask_torch, apply_bitmask_triton, unpack_bitmask
from tests.heldout import HELDOUT

MASKBENCH = HELDOUT / "jsonschemabench" / "maskbench_sample.jsonl"
SUITE = HELDOUT / "json-schema-test-suite" / "draft2020-12"

# Valid maskbench instances the grammar refuses: (schema id, index into its tests) -> why. The test
# fails on any refusal not listed here, and on a listed one that no longer happens.
MASKBENCH_KNOWN = {
    # llguidance generates an object's properties in the order the schema lists them; these instances
    # list them in another order ("id" or "type" first)
    ("Github_medium---o57617", 0): "property order (ROIs items: id before angle)",
    ("Github_medium---o57617", 1): "property order (ROIs items: id before angle)",
    ("Github_ultra---o359", 0): "property order (source: type before azureTableSourceQuery)",
    # JSON Schema counts 6000.0 as an integer; llguidance's integer grammar has no fraction part
    ("Github_ultra---o46322", 0): "integer-valued float 6000.0 for an integer",
}
MASKBENCH_MAX_REFUSED = 115  # of 544 schemas; measured 109 (not, dependencies, uniqueItems, formats, ...)

# JSON Schema Test Suite (draft 2020-12) cases where the grammar disagrees with `valid`:
# (file, schema description, test description) -> why. Every one is a valid instance refused.
_PROPERTY_ORDER = "property order: the grammar follows the schema's order"
_INT_FLOAT = "integer-valued float (1.0, -2.0 ...): llguidance writes integers without a fraction"
_FORMAT = "format asserted: llguidance enforces formats, 2020-12 makes format an annotation only"
SUITE_KNOWN = {
    ("allOf.json", "allOf", "allOf"): _PROPERTY_ORDER,
    ("allOf.json", "allOf with base schema", "valid"): _PROPERTY_ORDER,
    (
        "const.json",
        "const with object",
        "same object with different property order is valid",
    ): _PROPERTY_ORDER,
    ("const.json", "const with 0 does not match other zero-like types", "float zero is valid"): _INT_FLOAT,
    ("const.json", "const with 1 does not match true", "float one is valid"): _INT_FLOAT,
    ("const.json", "const with -2.0 matches integer and float types", "float -2.0 is valid"): _INT_FLOAT,
    (
        "const.json",
        "float and integers are equal up to 64-bit representation limits",
        "float is valid",
    ): _INT_FLOAT,
    ("enum.json", "enum with 0 does not match false", "float zero is valid"): _INT_FLOAT,
    ("enum.json", "enum with [0] does not match [false]", "[0.0] is valid"): _INT_FLOAT,
    ("enum.json", "enum with 1 does not match true", "float one is valid"): _INT_FLOAT,
    ("enum.json", "enum with [1] does not match [true]", "[1.0] is valid"): _INT_FLOAT,
    (
        "type.json",
        "integer type matches integers",
        "a float with zero fractional part is an integer",
    ): _INT_FLOAT,
}
for _fmt in ("email", "ipv4", "ipv6", "hostname", "date", "date-time", "time", "uri", "uuid", "duration"):
    SUITE_KNOWN[
        ("format.json", f"{_fmt} format", f"invalid {_fmt} string is only an annotation by default")
    ] = _FORMAT
SUITE_MIN_COMPILED = 165  # of 368 schemas (refRemote.json and optional/ skipped); measured 169


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(smollm_tokenizer):
    return smollm_tokenizer


@pytest.fixture(scope="module")
def backend(tok):
    pytest.importorskip("llguidance")
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend.from_tokenizer(tok)


@pytest.fixture(scope="module")
def maskbench():
    if not MASKBENCH.exists():
        pytest.skip(f"held-out data not found: {MASKBENCH}")
    with open(MASKBENCH) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def compiled_maskbench(backend, maskbench):
    """id -> compiled grammar (or the ValueError's text), and each compile's seconds."""
    out, seconds = {}, []
    for row in maskbench:
        spec = OutputConstraint.json_schema(row["schema"])
        t0 = time.perf_counter()
        try:
            out[row["id"]] = backend.compile(spec)
        except ValueError as e:
            out[row["id"]] = str(e)
        seconds.append(time.perf_counter() - t0)
    return out, seconds


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def serializations(data) -> tuple[str, str]:
    compact = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return compact, json.dumps(data, ensure_ascii=False, indent=2)


class Driver:
    """Feeds token ids to fresh matchers the engine's way (see the module docstring); times the fills."""

    def __init__(self, backend):
        self.backend = backend
        self.bitmask = allocate_bitmask(1, backend.vocab_size)
        self.row = self.bitmask[0]
        self.bits = self.bitmask.numpy()[0]
        self.eos = min(backend.eos_token_ids)
        self.fills = 0
        self.fill_s = 0.0

    def allowed(self, t: int) -> bool:
        return bool((int(self.bits[t >> 5]) >> (t & 31)) & 1)

    def fill(self, m) -> None:
        t0 = time.perf_counter()
        m.fill_bitmask(self.row)
        self.fill_s += time.perf_counter() - t0
        self.fills += 1
        assert self.allowed(self.eos) == m.is_accepting() or m.error, "EOS allowed iff the grammar may end"

    def run(self, grammar, ids: list[int]) -> bool:
        m = grammar.matcher()
        for t in ids:
            self.fill(m)
            if m.error:
                return False
            if not self.allowed(t):  # the mask may be stricter than accept(): see the docstring
                return False
            assert m.accept([t]), f"the mask allows token {t} but the matcher refuses it"
        self.fill(m)
        return self.allowed(self.eos) and m.is_accepting()

    def run_all(self, grammar, texts: list[list[int]]) -> list[bool]:
        """[run(grammar, ids) for ids in texts], the texts walked as a trie: a prefix several of them
        share is filled, checked and accepted once, on one matcher (a matcher's state, so its mask, is
        that of the tokens it accepted), copied where they part. Every fill and accept run() makes is
        made here on a matcher with the same tokens accepted, with the same assertions and verdicts."""
        verdicts: list[bool | None] = [None] * len(texts)
        todo = [(grammar.matcher(), 0, list(range(len(texts))))]  # (matcher, depth, texts through it)
        while todo:
            m, depth, through = todo.pop()
            self.fill(m)
            if m.error:
                for i in through:
                    verdicts[i] = False
                continue
            after: dict[int, list[int]] = {}  # next token -> the texts that go on with it
            for i in through:
                if len(texts[i]) == depth:
                    verdicts[i] = self.allowed(self.eos) and m.is_accepting()
                else:
                    after.setdefault(texts[i][depth], []).append(i)
            allowed = [(t, going) for t, going in after.items() if self.allowed(t)]  # before the next fill
            for t, going in after.items():
                if not self.allowed(t):  # the mask may be stricter than accept(): see the docstring
                    for i in going:
                        verdicts[i] = False
            for k, (t, going) in enumerate(allowed):
                child = m if k == len(allowed) - 1 else m.copy()
                assert child.accept([t]), f"the mask allows token {t} but the matcher refuses it"
                todo.append((child, depth + 1, going))
        assert None not in verdicts
        return verdicts


# -- OutputConstraint ------------------------------------------------------------------------------------
def test_the_backend_reads_the_tokenizer_as_llguidance_does(tok, backend):
    """from_tokenizer skips llguidance's copy of the Rust tokenizer (nothing to turn off): the same
    vocabulary, end tokens and tokenization as llguidance.hf.from_tokenizer's own tokenizer."""
    import llguidance.hf

    ours, theirs = backend.tokenizer, llguidance.hf.from_tokenizer(tok)
    assert tok.backend_tokenizer.padding is None and tok.backend_tokenizer.truncation is None
    assert ours.vocab_size == theirs.vocab_size and ours.eos_tokens == theirs.eos_tokens
    assert all(ours.decode_bytes([t]) == theirs.decode_bytes([t]) for t in range(ours.vocab_size))
    for text in ("Hello, world!", '{"a": [1, 2.5e-3, "\u00e9"]}', "  two  spaces\n\ttab", "日本語 ünïcödé"):
        ids = tok.encode(text, add_special_tokens=False)
        assert ours.tokenize_str(text) == theirs.tokenize_str(text) == ids


def test_spec_is_canonical_and_hashable():
    a = OutputConstraint.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    b = OutputConstraint.json_schema('{"type": "object",  "properties": {"b": {}, "a": {}}}')
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert a.value == '{"type":"object","properties":{"b":{},"a":{}}}'  # property order is kept
    assert a != OutputConstraint.json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    assert a != OutputConstraint.json_schema(a.value, whitespace_flexible=False)
    assert OutputConstraint.json_schema(True).value == "{}"
    assert OutputConstraint.choice(["x", "y"]).value == '["x", "y"]'
    assert (
        len(
            {OutputConstraint.regex("a+"), OutputConstraint.regex("a+"), OutputConstraint.lark("start: /a+/")}
        )
        == 2
    )
    with pytest.raises(AttributeError):
        a.kind = "regex"  # frozen


def test_spec_from_response_format():
    assert OutputConstraint.from_response_format({"type": "text"}) is None
    assert OutputConstraint.from_response_format({"type": "json_object"}) == OutputConstraint.json_object()
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": True}}
    assert OutputConstraint.from_response_format(rf) == OutputConstraint.json_schema({"type": "integer"})
    no_schema = {"type": "json_schema", "json_schema": {"name": "p"}}
    assert OutputConstraint.from_response_format(no_schema) == OutputConstraint.json_schema({})
    bad = {
        "response_format must be an object": "json_schema",
        "response_format.type must be": {"type": "xml"},
        "unknown field(s) 'schema'": {"type": "json_object", "schema": {}},
        "response_format.json_schema must be an object": {"type": "json_schema"},
        "name is required": {"type": "json_schema", "json_schema": {"schema": {}}},
        "strict must be a boolean": {"type": "json_schema", "json_schema": {"name": "n", "strict": "yes"}},
        "schema must be a JSON object, got an array": {
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": []},
        },
        "unknown field(s) 'schemas'": {"type": "json_schema", "json_schema": {"name": "n", "schemas": {}}},
        "matches nothing": {"type": "json_schema", "json_schema": {"name": "n", "schema": False}},
    }
    for message, shape in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            OutputConstraint.from_response_format(shape)


def test_spec_from_vllm_fields():
    so = OutputConstraint.from_structured_outputs
    assert so({}) is None and so({"json_object": False}) is None
    assert so({"json": '{"type": "string"}'}) == OutputConstraint.json_schema({"type": "string"})
    assert so({"json": {"type": "string"}, "disable_any_whitespace": True}).whitespace_flexible is False
    assert so({"regex": "[0-9]+"}) == OutputConstraint.regex("[0-9]+")
    assert so({"choice": ["a", "b"]}) == OutputConstraint.choice(["a", "b"])
    assert so({"grammar": 'start: "x"'}) == OutputConstraint.lark('start: "x"')
    assert so({"json_object": True, "disable_fallback": True}) == OutputConstraint.json_object()
    bad = {
        "set only one of json, regex": {"json": {}, "regex": "a"},
        "unknown field(s) 'jsn'": {"jsn": {}},
        "structural_tag is not supported": {"structural_tag": "{}"},
        "disable_additional_properties is not supported": {"json": {}, "disable_additional_properties": True},
        "structured_outputs.json: the schema is not valid JSON": {"json": "{nope"},
        "structured_outputs.choice: item 1 is a number": {"choice": ["a", 1]},
        "structured_outputs.choice: expected a non-empty list": {"choice": []},
        "structured_outputs.regex: the pattern must be a string": {"regex": 5},
        "whitespace options apply to json, not regex": {"regex": "a", "disable_any_whitespace": True},
    }
    for message, shape in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            so(shape)
    assert OutputConstraint.from_guided() is None
    assert OutputConstraint.from_guided(guided_choice=["y", "n"]) == OutputConstraint.choice(["y", "n"])
    with pytest.raises(ValueError, match="guided_json: the schema is not valid JSON"):
        OutputConstraint.from_guided(guided_json="{")
    with pytest.raises(ValueError, match="options apply to JSON kinds only"):
        OutputConstraint("regex", "a", lenient=True)


# -- held-out JSON Schema data --------------------------------------------------------------------
def test_maskbench_valid_accepted_invalid_refused(backend, tok, maskbench, compiled_maskbench):
    """Every maskbench schema the backend compiles accepts each `valid` instance and refuses each
    `invalid` one, compact and indented, driven token by token as the engine will (see `Driver`).
    Invalid rows flagged python_jsonschema_4_26_disagrees are format-dependent: not checked."""
    grammars, compile_s = compiled_maskbench
    driver = Driver(backend)
    refused = {k: v for k, v in grammars.items() if isinstance(v, str)}
    disagreements: set[tuple[str, int]] = set()
    checked = {True: 0, False: 0}
    for row in maskbench:
        g = grammars[row["id"]]
        if isinstance(g, str):
            continue
        cases, texts = [], []  # a row's instance texts share prefixes: one trie walk (Driver.run_all)
        for i, case in enumerate(row["tests"]):
            if not case["valid"] and case.get("python_jsonschema_4_26_disagrees"):
                continue
            for text in serializations(case["data"]):
                checked[case["valid"]] += 1
                cases.append((i, case["valid"]))
                texts.append(encode(tok, text))
        for (i, valid), verdict in zip(cases, driver.run_all(g, texts)):
            if verdict != valid:
                disagreements.add((row["id"], i))
    ms = sorted(s * 1e3 for s in compile_s)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(
        f"\nmaskbench: {len(maskbench)} schemas, {len(refused)} refused; instance texts checked: "
        f"{checked[True]} valid, {checked[False]} invalid; {len(disagreements)} known disagreements; "
        f"compile p50 {statistics.median(ms):.2f} ms, "
        f"p99 {p99:.2f} ms, max {ms[-1]:.2f} ms; fill_bitmask "
        f"{driver.fill_s / driver.fills * 1e6:.1f} us/call over {driver.fills} calls"
    )
    reasons: dict[str, int] = {}
    for msg in refused.values():
        reasons[msg[:90]] = reasons.get(msg[:90], 0) + 1
    for msg, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  refused {n:3d}: {msg}")
    assert len(refused) <= MASKBENCH_MAX_REFUSED, f"{len(refused)} schemas refused"
    assert all(m.startswith("invalid JSON schema: ") for m in refused.values())
    assert disagreements == set(MASKBENCH_KNOWN), {
        "new": sorted(disagreements - set(MASKBENCH_KNOWN)),
        "gone": sorted(set(MASKBENCH_KNOWN) - disagreements),
    }


def test_json_schema_test_suite(backend, tok):
    """The official JSON Schema Test Suite, draft 2020-12 (refRemote.json needs remotes/ and optional/
    is skipped): each schema the backend compiles agrees with every test's `valid`, compact and
    indented, except the listed cases."""
    if not SUITE.is_dir():
        pytest.skip(f"held-out data not found: {SUITE}")
    driver = Driver(backend)
    schemas = compiled = checked = 0
    disagreements: set[tuple[str, str, str]] = set()
    for path in sorted(glob.glob(str(SUITE / "*.json"))):
        name = os.path.basename(path)
        if name == "refRemote.json":
            continue
        with open(path) as f:
            groups = json.load(f)
        for group in groups:
            schemas += 1
            try:
                g = backend.compile(OutputConstraint.json_schema(group["schema"]))
            except ValueError:
                continue
            compiled += 1
            for case in group["tests"]:
                for text in serializations(case["data"]):
                    checked += 1
                    if driver.run(g, encode(tok, text)) != case["valid"]:
                        disagreements.add((name, group["description"], case["description"]))
    print(
        f"\nJSON Schema Test Suite 2020-12: {compiled} of {schemas} schemas compile; {checked} instance "
        f"texts, {checked - 2 * len(disagreements)} agree, {len(disagreements)} known cases (x2 "
        "serializations) disagree"
    )
    assert compiled >= SUITE_MIN_COMPILED
    assert disagreements == set(SUITE_KNOWN), {
        "new": sorted(disagreements - set(SUITE_KNOWN)),
        "gone": sorted(set(SUITE_KNOWN) - disagreements),
    }


def test_a_failed_matcher_does_not_break_the_grammar(backend, tok, maskbench, caplog):
    """Accepting hundreds of tokens in one call can exhaust one step's lexer fuel, which breaks the
    lexer every copy of a compiled grammar shares (without the rebuild, the next request's first token
    is refused); the grammar then rebuilds its template, so the next request works. With an llguidance
    that no longer runs out here, the first accept simply succeeds."""
    row = next(r for r in maskbench if r["id"] == "Github_ultra---o21135")
    compact, indented = serializations(next(c for c in row["tests"] if c["valid"])["data"])
    g = backend.compile(OutputConstraint.json_schema(row["schema"]))
    with caplog.at_level(logging.INFO, logger="foveal.structured.llguidance_backend"):
        first = g.matcher().accept(encode(tok, compact))  # llguidance 1.9: False (out of fuel)
        assert Driver(backend).run(g, encode(tok, indented))
    assert first or "rebuilt its template" in caplog.text


# -- regex, choice, Lark -----------------------------------------------------------------------------
def accepts(backend, tok, spec: OutputConstraint, text: str) -> bool:
    return Driver(backend).run(backend.compile(spec), encode(tok, text))


@pytest.mark.parametrize(
    "spec, good, bad",
    [
        (
            OutputConstraint.regex(r"[0-9]{3}-[a-z]+"),
            ["123-abc", "000-z"],
            ["123-", "12-abc", "123-abc!", "x123-abc"],
        ),
        (OutputConstraint.regex(r"(yes|no)"), ["yes", "no"], ["ye", "yess", "no ", ""]),
        (OutputConstraint.regex(r"a+"), ["a", "aaaa"], ["", "ab", "b"]),
        (
            OutputConstraint.choice(["red", "green", "dark green"]),
            ["red", "green", "dark green"],
            ["re", "dark", "blue"],
        ),
        (
            OutputConstraint.choice(['say "hi"', "a\\b", "é 中文", ""]),
            ['say "hi"', "a\\b", "é 中文", ""],
            ["say", "a"],
        ),
        (
            OutputConstraint.lark('start: "(" num ("," num)* ")"\nnum: /[0-9]+/'),
            ["(1)", "(12,3,456)"],
            ["()", "(1,)", "(1", "(1)(2)", "1"],
        ),
        (OutputConstraint.lark('root ::= "yes" | "no"'), ["yes", "no"], ["y", "maybe"]),  # GBNF, converted
    ],
)
def test_full_match_semantics(backend, tok, spec, good, bad):
    """The whole output must match: a matching prefix is not accepted at the end (EOS refused)."""
    for s in good:
        assert accepts(backend, tok, spec, s), (spec.describe(), s)
    for s in bad:
        assert not accepts(backend, tok, spec, s), (spec.describe(), s)


@pytest.mark.parametrize(
    "spec, message",
    [
        (OutputConstraint.json_schema({"type": "foo"}), "invalid JSON schema: Invalid type: foo"),
        (OutputConstraint.json_schema({"$ref": "#/$defs/nope"}), "invalid JSON schema: .*does not exist"),
        (
            OutputConstraint.json_schema({"type": "string", "pattern": "a(b"}),
            "invalid JSON schema: regex parse error",
        ),
        (
            OutputConstraint.json_schema({"minimum": 5, "maximum": 1, "type": "integer"}),
            "Unsatisfiable schema",
        ),
        (OutputConstraint.json_schema({"not": {"type": "string"}}), r"Unimplemented keys: \[\"not\"\]"),
        (OutputConstraint.json_schema({"type": "string", "format": "colour"}), "Unknown format: colour"),
        (OutputConstraint.regex("a(b"), "(?s)^invalid regex: regex parse error:.*error: unclosed group$"),
        (OutputConstraint.regex("[z-a]"), "invalid regex: "),
        (OutputConstraint.lark("start: foo"), 'invalid grammar: .*unknown name: "foo"'),
        (OutputConstraint.lark('x: "a"'), "invalid grammar: no start rule"),
        (OutputConstraint.lark("start: /[/"), "(?s)invalid grammar: .*unclosed character class"),
    ],
)
def test_bad_specs_raise_value_error(backend, spec, message):
    with pytest.raises(ValueError, match=message):
        backend.compile(spec)


def test_lenient_schema_compiles_with_warnings(backend, tok):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ValueError, match="uniqueItems"):
        backend.compile(OutputConstraint.json_schema(schema))
    g = backend.compile(OutputConstraint.json_schema(schema, lenient=True))
    assert any("uniqueItems" in w for w in g.warnings)
    assert Driver(backend).run(g, encode(tok, "[1, 1]"))  # the ignored keyword is not enforced


def test_whitespace_options(backend, tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tight = OutputConstraint.json_schema(schema, whitespace_flexible=False)
    assert accepts(backend, tok, tight, '{"a":1}') and not accepts(backend, tok, tight, '{"a": 1}')
    assert accepts(backend, tok, OutputConstraint.json_schema(schema), '{\n  "a" : 1 }')
    assert accepts(backend, tok, OutputConstraint.json_object(), '{"x": [1, {"y": null}]}')
    assert not accepts(backend, tok, OutputConstraint.json_object(), "[1]")


# -- the matcher: sampling loop, EOS, rollback ----------------------------------------------------
def sample_until_eos(backend, tok, grammar, gen: torch.Generator, bias: torch.Tensor, max_steps: int):
    """Random logits (+ bias) on a padded LM head, masked, temperature 1: fill -> apply -> draw ->
    accept, until EOS (None if the walk is still going after max_steps)."""
    m = grammar.matcher()
    bitmask = allocate_bitmask(1, backend.vocab_size)
    out: list[int] = []
    for _ in range(max_steps):
        m.fill_bitmask(bitmask[0])
        assert m.error is None
        logits = torch.randn(1, bias.shape[0], generator=gen) + bias
        apply_bitmask_torch(logits, bitmask)
        t = int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen))
        assert t < backend.vocab_size and m.accept([t])
        if t in backend.eos_token_ids:
            assert m.is_terminated()
            return tok.decode(out)
        out.append(t)
    return None


def test_constrained_sampling_produces_valid_json(backend, tok, maskbench, compiled_maskbench):
    """Masked random sampling always yields JSON that validates: 10 maskbench schemas (the first, in
    file order from every 17th, whose walk ends within 300 tokens) and json_object. Unbiased random
    logits would almost never close a string (few tokens hold a quote), so tokens holding `"`, `}` or
    `]` get +6; compact whitespace, for the same reason (random logits love whitespace runs)."""
    jsonschema = pytest.importorskip("jsonschema")
    grammars, _ = compiled_maskbench
    bias = torch.zeros(backend.vocab_size + 64)  # 64 padding columns: the mask must keep them out
    for t, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if any(c in piece for c in '"}]'):
            bias[t] = 6.0
    gen = torch.Generator().manual_seed(0)
    done = tried = 0
    for row in maskbench[::17]:
        if isinstance(grammars[row["id"]], str) or done == 10:
            continue
        tried += 1
        g = backend.compile(OutputConstraint.json_schema(row["schema"], whitespace_flexible=False))
        text = sample_until_eos(backend, tok, g, gen, bias, max_steps=300)
        if text is None:
            continue
        jsonschema.validators.validator_for(row["schema"])(row["schema"]).validate(json.loads(text))
        done += 1
    assert done == 10 and tried <= 13, (done, tried)
    g = backend.compile(OutputConstraint.json_object(whitespace_flexible=False))
    for _ in range(3):
        assert isinstance(json.loads(sample_until_eos(backend, tok, g, gen, bias, max_steps=300)), dict)


def test_eos_allowed_exactly_when_the_grammar_can_end(backend, tok):
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    two_eos = LLGuidanceBackend.from_tokenizer(tok, eos_token_ids=[0, 2])
    g = two_eos.compile(OutputConstraint.regex("ab(c)?"))
    m = g.matcher()
    bm = allocate_bitmask(1, two_eos.vocab_size)

    def allowed() -> set[int]:
        return set(unpack_bitmask(bm, two_eos.vocab_size)[0].nonzero().flatten().tolist())

    m.fill_bitmask(bm[0])
    assert not allowed() & {0, 2} and not m.is_accepting()
    assert not m.accept([2]) and m.num_tokens == 0  # EOS too early: refused, nothing consumed
    assert m.accept(encode(tok, "ab"))
    m.fill_bitmask(bm[0])
    assert {0, 2} <= allowed() and m.is_accepting() and not m.is_terminated()  # may end, or add "c"
    assert m.accept(encode(tok, "c"))
    m.fill_bitmask(bm[0])
    assert allowed() == {0, 2} and m.is_terminated()  # complete: only EOS
    assert m.accept([0]) and m.is_terminated() and m.num_tokens == 3
    assert not m.accept(encode(tok, "c"))


def test_rollback_then_reaccept_gives_the_same_masks(backend, tok):
    props = {"name": {"type": "string"}, "n": {"type": "integer"}}
    g = backend.compile(
        OutputConstraint.json_schema({"type": "object", "properties": props, "required": ["name", "n"]})
    )
    ids = encode(tok, '{"name": "rollback test", "n": 12345}') + [min(backend.eos_token_ids)]
    m = g.matcher()
    bm = allocate_bitmask(len(ids) + 1, backend.vocab_size)
    for i, t in enumerate(ids):
        m.fill_bitmask(bm[i])
        assert m.accept([t])
    m.fill_bitmask(bm[len(ids)])
    assert m.is_terminated() and m.num_tokens == len(ids)
    row = allocate_bitmask(1, backend.vocab_size)[0]
    for k in (1, 3, len(ids) // 2, len(ids)):  # 1 undoes the EOS
        m.rollback(k)
        assert m.num_tokens == len(ids) - k
        m.fill_bitmask(row)
        assert torch.equal(row, bm[len(ids) - k]), k
        assert m.accept(ids[len(ids) - k :])
        m.fill_bitmask(row)
        assert torch.equal(row, bm[len(ids)]) and m.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back"):
        m.rollback(len(ids) + 1)
    assert m.error is None and m.num_tokens == len(ids)  # a refused rollback changes nothing
    m.reset()
    m.fill_bitmask(row)
    assert torch.equal(row, bm[0]) and m.num_tokens == 0
    # the same without masks on the way: llguidance then records the EOS itself
    m = g.matcher()
    assert m.accept(ids) and m.num_tokens == len(ids)
    m.rollback(1)
    m.fill_bitmask(row)
    assert torch.equal(row, bm[len(ids) - 1]) and m.is_terminated()


def test_accept_is_all_or_nothing_and_validate_counts(backend, tok):
    g = backend.compile(OutputConstraint.regex("[a-z]+ [0-9]+"))
    m = g.matcher()
    ids = encode(tok, "abc 123")
    bad = encode(tok, "abc") + encode(tok, "!")
    assert m.validate(bad) == len(bad) - 1 and m.validate(ids) == len(ids)
    assert not m.accept(bad) and m.num_tokens == 0 and m.error is None
    assert m.accept(ids) and m.num_tokens == len(ids) and m.is_accepting()


def test_matchers_are_independent_and_batch_fill_matches(backend, tok):
    g = backend.compile(OutputConstraint.choice(["alpha", "beta"]))
    a, b, c = g.matcher(), g.matcher(), g.matcher()
    assert a.accept(encode(tok, "alpha")) and b.accept(encode(tok, "be"))
    batch = allocate_bitmask(4, backend.vocab_size)
    backend.fill_bitmasks([a, b, c], batch)
    for i, m in enumerate((a, b, c)):
        one = allocate_bitmask(1, backend.vocab_size)
        m.fill_bitmask(one[0])
        assert torch.equal(one[0], batch[i]), i
    assert (batch[3] == -1).all()  # rows past the matchers untouched
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[1], batch[2])


def test_matchers_from_many_threads(backend, tok):
    g = backend.compile(OutputConstraint.regex("[0-9]{1,8}"))
    ids = encode(tok, "12345678")
    results: list[bool] = []

    def work():
        for _ in range(50):
            m = g.matcher()
            results.append(m.accept(ids) and m.is_accepting())

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [True] * 200


def test_padded_vocab_bits_are_never_set(tok):
    pytest.importorskip("llguidance")
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    be = LLGuidanceBackend.from_tokenizer(tok, vocab_size=len(tok) + 40)  # not a multiple of 32
    assert be.vocab_size == len(tok) + 40 and bitmask_words(be.vocab_size) == (len(tok) + 40 + 31) // 32
    m = be.compile(OutputConstraint.json_object()).matcher()
    bm = allocate_bitmask(1, be.vocab_size)
    m.fill_bitmask(bm[0])
    allowed = unpack_bitmask(bm, bitmask_words(be.vocab_size) * 32)[0]
    assert allowed[: len(tok)].any() and not allowed[len(tok) :].any()
    with pytest.raises(ValueError, match="vocab size too small|cannot use this tokenizer"):
        LLGuidanceBackend.from_tokenizer(tok, vocab_size=len(tok) - 1)


# -- the grammar cache ---------------------------------------------------------------------------------
def test_grammar_cache_counts_and_evicts(backend):
    cache = GrammarCache(backend, max_entries=2)
    s1, s2, s3 = OutputConstraint.regex("a"), OutputConstraint.regex("b"), OutputConstraint.regex("c")
    g1 = cache.get(s1)
    assert cache.get(OutputConstraint.regex("a")) is g1  # an equal spec is a hit
    cache.get(s2)
    cache.get(s1)  # s1 most recent: s2 goes first
    cache.get(s3)
    assert s1 in cache and s3 in cache and s2 not in cache
    with pytest.raises(ValueError, match="invalid regex"):
        cache.get(OutputConstraint.regex("("))
    with pytest.raises(ValueError):
        cache.get(OutputConstraint.regex("("))  # errors are not cached
    st = cache.stats()
    assert (st.hits, st.misses, st.errors, st.entries) == (2, 5, 2, 2) and st.compile_seconds > 0


def test_grammar_cache_compiles_once_under_concurrency(backend):
    calls: list[OutputConstraint] = []
    gate = threading.Event()

    class Slow:
        def compile(self, spec):
            calls.append(spec)
            gate.wait(5)
            return backend.compile(spec)

    cache = GrammarCache(Slow())
    spec = OutputConstraint.json_schema({"type": "integer"})
    out = []
    threads = [threading.Thread(target=lambda: out.append(cache.get(spec))) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(out) == 4 and all(g is out[0] for g in out)
    assert (cache.stats().misses, cache.stats().hits) == (1, 3)


# -- bitmask apply: torch, Triton (interpreter on CPU), Python reference ----------------------------
def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> torch.Tensor:
    out = logits.clone()
    words = bitmask.shape[1]
    rows = list(range(bitmask.shape[0])) if rows is None else list(rows)
    for i, r in enumerate(rows):
        if r < 0:
            continue
        for t in range(logits.shape[1]):
            w = t // 32
            if w >= words or not (int(bitmask[i, w]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def random_bitmask(n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    bm = torch.randint(-(2**31), 2**31, (n, bitmask_words(vocab)), dtype=torch.int64, generator=gen)
    return bm.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "vocab, width, rows",
    [
        (256, 256, None),  # exact width, every row constrained
        (250, 300, None),  # logits wider than the mask: padding columns -> -inf
        (250, 301, [3, 0, 5]),  # some rows free, out of order
        (64, 100, [2, -1, 0]),  # a padding entry in rows
    ],
)
def test_apply_bitmask_matches_reference(vocab, width, rows, dtype):
    gen = torch.Generator().manual_seed(vocab + width)
    n_rows = 6
    bm = random_bitmask(n_rows if rows is None else len(rows), vocab, gen)
    logits = torch.randn(n_rows, width, generator=gen).to(dtype)
    want = reference_apply(logits, bm, rows)
    got = logits.clone()
    apply_bitmask_torch(got, bm, rows)
    assert torch.equal(got, want)
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.importorskip("triton")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        got = logits.clone().to(device)
        apply_bitmask_triton(got, bm.to(device), rows)
        assert torch.equal(got.cpu(), want)


def test_apply_bitmask_model_sized_torch_vs_triton():
    """A real vocabulary (49152, mask of 1536 words) on a padded LM head (49216), strided logits."""
    gen = torch.Generator().manual_seed(1)
    vocab, width = 49152, 49216
    bm = random_bitmask(3, vocab, gen)
    bm[1] = 0  # nothing allowed
    bm[2] = -1  # everything allowed
    base = torch.randn(5, width + 16, generator=gen)[:, :width]  # row stride != width
    want = base.clone()
    apply_bitmask_torch(want, bm, [4, 1, 2])
    assert torch.isinf(want[1]).all() and torch.equal(want[0], base[0])
    assert torch.isinf(want[2, vocab:]).all() and torch.equal(want[2, :vocab], base[2, :vocab])
    expect = unpack_bitmask(bm[0:1], width)[0]
    assert torch.equal(torch.isfinite(want[4]), expect)
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        pytest.importorskip("triton")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        got = base.clone().to(device)
        apply_bitmask_triton(got, bm.to(device), torch.tensor([4, 1, 2], device=device))
        assert torch.equal(got.cpu(), want)


def test_apply_bitmask_checks_shapes():
    logits = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="pass rows"):
        apply_bitmask_torch(logits, torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask_torch(logits, torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="row indices"):
        apply_bitmask_torch(logits, torch.zeros(1, 2, dtype=torch.int32), [0, 1])
    apply_bitmask_torch(logits, torch.zeros(0, 2, dtype=torch.int32), [])  # no constrained rows
    assert (logits == 0).all()
    assert np.array_equal(allocate_bitmask(2, 33).numpy(), np.full((2, 2), -1, dtype=np.int32))


# -- size limits before the native compiler (issue 34) --------------------------------------------------
@pytest.mark.parametrize(
    "pattern,size",
    [("abc", 3), ("a{1000}", 1000), ("(ab){10}{10}", 200), ("((a{100}){100}){100}", 1_000_000),
     ("a{3,}", 4), ("a{2,5}b*", 6), (r"\{1000\}", 6), ("[a{9}]{4}", 4), ("(a|bc){3}", 9), ("x{,5}", 5),
     ("(?:ab){10}", 20), ("(?P<n>ab){3}", 6), ("(?i)abc", 3), ("(?i:ab){2}", 4), ("(?=a)b", 2)],
)  # fmt: skip
def test_regex_size_multiplies_repetition_bounds(pattern, size):
    from foveal.structured.limits import regex_size

    assert regex_size(pattern) == size


def test_size_limits_name_what_is_too_big():
    from foveal.structured import limits

    small = limits.GrammarLimits(max_alternatives=3, max_schema_arms=2, max_rules=2, max_regex_size=10,
                                 max_schema_nodes=5, max_schema_depth=3)  # fmt: skip
    ok = [OutputConstraint.choice(["a", "b", "c"]), OutputConstraint.regex("a{10}"),
          OutputConstraint.lark('start: "a" | "b"'),
          OutputConstraint.json_schema({"enum": list("abcdefgh")})]  # fmt: skip
    for spec in ok:
        limits.check(spec, small)
    bad = [
        (OutputConstraint.choice(["a", "b", "c", "d"]), "choices: 4 is over the limit of 3"),
        (OutputConstraint.regex("a{11}"), "the regex expands to 11"),
        (OutputConstraint.lark('start: x\nx: y\ny: "a"'), "grammar rules: 3"),
        (OutputConstraint.lark('start: "a" | "b" | ("c" | "d" | "e" | "f")'), "alternatives in one group"),
        (
            OutputConstraint.lark('start: "a|b|c|d" | /x|y|z|w/ | "e" | "f"'),
            "alternatives of one grammar rule: 4",
        ),
        (OutputConstraint.lark("start: /a{20}/"), "the grammar's regex /a{20}/"),
        (OutputConstraint.json_schema({"anyOf": [{}, {}, {}]}), "#/anyOf: 3"),
        (OutputConstraint.json_schema({"properties": {"a": {"pattern": "b{30}"}}}),
         "the pattern at #/properties/a"),
        (OutputConstraint.json_schema({"items": {"items": {"items": {"type": "string"}}}}),
         "nesting at #/items/items/items"),
        (OutputConstraint.json_schema({"allOf": [{"type": "string"}] * 2,
                                  "properties": {"a": {}, "b": {}, "c": {}}}), "subschemas"),
        (OutputConstraint.json_object(whitespace_pattern="( ){99}"), "whitespace_pattern"),
    ]  # fmt: skip
    for spec, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            limits.check(spec, small)
    # the `|` inside a literal, a regex or a comment is not an alternation of the grammar
    limits.check(OutputConstraint.lark('start: "a|b|c|d" // x | y | z | w\n  | "e"'), small)


def test_compile_refuses_over_limit_specs_before_compiling(backend):
    """The probe's over-limit grammars: a ValueError naming the limit, each in well under a second (a^1e6
    spent 0.4 s and ((a{100}){100}){100} 1.1 s building lexers before)."""
    specs = [
        OutputConstraint.choice([f"c{i}" for i in range(2001)]),
        OutputConstraint.regex("a{1000000}"),
        OutputConstraint.regex("((a{100}){100}){100}"),
        OutputConstraint.json_schema({"type": "string", "pattern": "^a{50000}$"}),
        OutputConstraint.lark("start: " + " | ".join(f'"w{i}"' for i in range(5000))),
    ]
    for spec in specs:
        with pytest.raises(ValueError, match="over the limit"):
            backend.compile(spec)


# over a 40-item row only once two choices are made: the compile's one-step probe passes it
RUNTIME_ROW = 'start: n n c\nn: "q" | "r"\nc: ' + " | ".join(f'"w{i}"' for i in range(60))


def small_row_backend(tok, items: int = 40):
    """A backend whose parser rows hold `items`: a small stand-in for a grammar over the 2,000."""
    from llguidance import LLParserLimits

    from foveal.structured.llguidance_backend import LLGuidanceBackend

    limits = LLParserLimits(max_items_in_row=items, verbose_errors=False)
    return LLGuidanceBackend.from_tokenizer(tok, limits=limits)


def test_a_grammar_over_a_parser_row_fails_its_compile(tok):
    """Over llguidance's row at the first token (here: a row of 40 items for 60 alternatives after
    "x"): found by the compile's one-step probe, refused as a ValueError, not at a request's first
    token."""
    small = small_row_backend(tok)
    alts = " | ".join(f'"w{i}"' for i in range(60))
    with pytest.raises(ValueError, match="items; max is 40"):
        small.compile(OutputConstraint.lark(f'start: "x" c\nc: {alts}'))
    small.compile(OutputConstraint.lark(RUNTIME_ROW))  # two choices deep: found when it runs


def test_a_failed_grammar_leaves_the_cache_and_is_refused(tok):
    small = small_row_backend(tok)
    cache = GrammarCache(small)
    spec = OutputConstraint.lark(RUNTIME_ROW)
    g = cache.get(spec)
    m = g.matcher()
    for b in (b"q", b"r", b"w"):  # the row of 60 alternatives comes after the second choice
        if m.error is None and m.accept(small.tokenize_bytes(b)):
            _fill_ok(small, m)
    assert m.error is not None and g.failure and "max is 40" in g.failure, (m.error, g.failure)
    for _ in range(2):
        with pytest.raises(ValueError, match="exceeded a limit when it ran"):
            cache.get(spec)
    st = cache.stats()
    assert (st.entries, st.refused, st.nbytes) == (0, 2, 0)


def _fill_ok(backend, m) -> bool:
    row = torch.zeros(bitmask_words(backend.vocab_size), dtype=torch.int32)
    m.fill_bitmask(row)
    return m.error is None


def test_grammar_cache_is_bounded_in_bytes(backend):
    specs = [OutputConstraint.choice([f"{i}-{j}" + "x" * 100 for j in range(100)]) for i in range(6)]
    one = backend.compile(specs[0]).nbytes
    cache = GrammarCache(backend, max_entries=100, max_bytes=3 * one + one // 2)
    for s in specs:
        cache.get(s)
    st = cache.stats()
    assert st.entries == 3 and st.nbytes <= 3 * one + one // 2
    assert specs[-1] in cache and specs[0] not in cache


def test_a_deep_rule_chain_compiles_on_the_compile_thread(backend):
    """3,000 chained rules overflowed an 8 MiB thread stack (the process died); the compile thread's
    256 MiB takes the 10,000-rule limit (16-32 MiB measured)."""
    rules = "".join(f'r{i}: "t" r{i + 1} | "u"\n' for i in range(9_998))
    g = backend.compile(OutputConstraint.lark("start: r0\n" + rules + 'r9998: "end"\n'))
    assert g.matcher().accept([backend.tokenize_bytes(b"t")[0]])


# -- closing plans on a budget -----------------------------------------------------------------------
def test_a_closing_plan_stops_at_its_budget(backend):
    """A string that may not close for 301 bytes, 8 tokens left: the search for a way out ran 7.6 s; on
    the default budget it gives up within it (None, counted), and the given-up search from the start is
    remembered for the grammar (the next request does not search again)."""
    from foveal.structured import closing

    g = backend.compile(OutputConstraint.json_schema({"type": "string", "minLength": 301}))
    c = closing.Closer(g)
    budget = closing.Budget()
    old, closing.BUDGET = closing.BUDGET, budget
    try:
        t = time.perf_counter()
        assert c.plan(g.matcher(), "", 8) is None
        took = time.perf_counter() - t
        assert budget.skipped == 1 and took < 1.0, took
        assert c.plan(g.matcher(), "", 8) is None and budget.skipped == 1  # remembered
        budget.new_step()
        budget.step_spent = budget.step_s  # this step's budget spent: the look waits
        assert c.plan(g.matcher(), "", 9) is closing.DEFER
    finally:
        closing.BUDGET = old


def test_text_the_vocabulary_cannot_write_is_the_grammars_fault(backend):
    """The embedded GGUF's vocabulary has no token starting with byte 0xf2 (nor 0x04, 0xf1, ...): a
    choice needing one is refused at compile; a grammar that needs it mid-way is caught where
    llguidance's mask offers the byte after it (which the matcher then refuses): `unwritable` says
    why, and the guide makes it the request's error, not the server's."""
    char = "\U000802bc"  # UTF-8 f2 80 8a bc
    assert 0xF2 not in backend.lead_bytes and ord("e") in backend.lead_bytes
    with pytest.raises(ValueError, match="choice 1 .* no token of this model's vocabulary writes"):
        backend.compile(OutputConstraint.choice(["x", f"e{char}w"]))
    m = backend.compile(OutputConstraint.lark(f'start: "e{char}w" | "x"')).matcher()
    assert m.unwritable() is None
    assert m.accept(backend.tokenize_bytes(b"e"))
    assert "byte 0xf2" in m.unwritable()
