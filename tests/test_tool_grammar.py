"""Tool-call grammars (foveal.structured.tool_grammar) for every format that has a call syntax, and the
constrained streaming of the calls they write (foveal.parsing.tool_formats.constrained).

For each format (hermes, qwen3_xml, llama3_json, mistral v3 and v11) and each tool_choice (required,
named, auto with a trigger), outputs are drawn at random from the grammar's own masks (a random walk
over the allowed tokens of a byte tokenizer, leaning towards closing characters so walks end), then:
the format's ordinary parser reads the same calls as the constrained stream; every call names an
offered function (the named one where named) and its arguments validate against its parameters; the
stream, in random chunks, joins to the whole parse; the id and name go out before the arguments are
complete. The engine then runs the same grammars on a tiny random model (required and named), with
the same checks through the server's output path (`ChoiceOutput`).
"""

from __future__ import annotations

import json
import random
import tempfile

import pytest
import torch

from foveal import SamplingParams
from foveal.parsing.output import ChoiceOutput, OutputPlan
from foveal.parsing.tools import ToolCallDelta, ToolCallStream, collect, parse
from foveal.structured.tool_grammar import tool_call_grammar

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 10},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
                "limit": {"type": ["number", "null"], "minimum": 0, "maximum": 1000},
            },
            "required": ["query", "exact"],
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NOARGS]
NONE = {"type": "object", "additionalProperties": False}  # a function without parameters takes none
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or NONE for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "search"}}
SPECIALS = ["[TOOL_CALLS]", "[ARGS]"]
PY = ["<|python_start|>", "<|python_end|>"]

# (format, the tokenizer's special tokens)
CASES = [
    ("hermes", []),
    ("qwen3_xml", []),
    ("llama3_json", []),
    ("mistral", ["[TOOL_CALLS]"]),  # v3: [TOOL_CALLS] [{...}, {...}]
    ("mistral", SPECIALS),  # v11: [TOOL_CALLS]name[ARGS]{...}
    ("pythonic", []),  # [f(a=1), g()]
    ("pythonic", PY),  # <|python_start|>[f(a=1)]<|python_end|> (Llama 4)
]


@pytest.fixture(scope="module")
def tokenizers():
    from tests.tiny_vlm import byte_tokenizer

    return {tuple(s): byte_tokenizer(s, "") for s in ([], ["[TOOL_CALLS]"], SPECIALS, PY)}


@pytest.fixture(scope="module")
def backends(tokenizers):
    from foveal.structured import GrammarCache
    from foveal.structured.llguidance_backend import LLGuidanceBackend

    return {
        k: GrammarCache(
            LLGuidanceBackend.from_tokenizer(t, vocab_size=len(t), eos_token_ids=[t.eos_token_id])
        )
        for k, t in tokenizers.items()
    }


def special_ids(tok, names) -> dict[str, int]:
    return {s: tok.convert_tokens_to_ids(s) for s in names}


CLOSERS = ("\n</parameter>\n",)


def walk(grammar, tok, rng: random.Random, prefix: str = "", max_steps: int = 600) -> tuple[str, bool]:
    """A random output the grammar allows: `prefix` forced, then random allowed tokens, favouring
    closing characters, special tokens, EOS and the next character of a closing tag. (the text with
    special tokens written out, whether it ended by EOS)."""
    m = grammar.matcher()
    ids = tok.encode(prefix, add_special_tokens=False)
    assert m.accept(ids), prefix
    words = (len(tok) + 31) // 32
    row = torch.zeros(words, dtype=torch.int32)
    piece = {t: tok.decode([t]) for t in range(256)}
    weight = {t: 8.0 for t, c in piece.items() if c in '"]}>\n'}
    weight.update({t: 0.02 for t, c in piece.items() if not (c.isprintable() and c.isascii())})
    weight.update({i: 30.0 for i in tok.all_special_ids})
    text = prefix
    for _ in range(max_steps):
        m.fill_bitmask(row)
        bits = row.numpy().view("uint32")
        allowed = [t for t in range(len(tok)) if bits[t // 32] >> (t % 32) & 1]
        assert allowed, text
        if tok.eos_token_id in allowed:
            return tok.decode(ids, skip_special_tokens=False), True

        def w(t: int, text: str = text) -> float:
            c = piece.get(t)
            if c and any(
                (text + c).endswith(k[:n]) for k in CLOSERS for n in range(2, len(k) + 1)
            ):  # the next character of a closing tag (its first one is not pushed)
                return 400.0
            return weight.get(t, 1.0)

        t = rng.choices(allowed, [w(a) for a in allowed])[0]
        assert m.accept([t])
        ids.append(t)
        text += piece.get(t, "")
    return tok.decode(ids, skip_special_tokens=False), False


def chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i : i + k])
        i += k
    return out


def check_calls(fmt: str, text: str, syntax, choice, rng: random.Random) -> list:
    """The checks of the module docstring on one output; returns its calls."""
    whole = parse(text, TOOLS, format=fmt, syntax=syntax)
    free = parse(text, TOOLS, format=fmt)  # the format's own parser reads the same calls
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in free.tool_calls
    ], text
    assert whole.content == free.content, text
    for c in whole.tool_calls:
        assert c.name in SCHEMAS and (not isinstance(choice, dict) or c.name == "search"), text
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    if choice != "auto":
        assert whole.tool_calls and whole.content is None, text
    stream = ToolCallStream(fmt, TOOLS, syntax)
    deltas, first_args = [], {}
    for piece in chunks(text, rng):
        for d in stream.feed(piece):
            deltas.append(d)
            if isinstance(d, ToolCallDelta) and d.id is not None:
                first_args[d.index] = len(deltas)
    deltas += stream.finish()
    joined = collect(deltas)
    assert [(c.name, c.arguments) for c in joined.tool_calls] == [
        (c.name, c.arguments) for c in whole.tool_calls
    ] and joined.content == whole.content
    return whole.tool_calls


@pytest.mark.parametrize("fmt,specials", CASES, ids=lambda x: x if isinstance(x, str) else str(len(x)))
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_random_outputs_of_the_grammar_parse_and_validate(tokenizers, backends, fmt, specials, choice):
    tok = tokenizers[tuple(specials)]
    c = NAMED if choice == "named" else choice
    constraint = tool_call_grammar(fmt, TOOLS, c, True, special_ids(tok, specials))
    grammar = backends[tuple(specials)].get(constraint.grammar)
    rng = random.Random(f"{fmt}{specials}{choice}")
    ended = calls = 0
    for i in range(12):
        prefix = ""
        if choice == "auto" and constraint.syntax.trigger:  # free text, then (every other time) the trigger
            prefix = "Let me check." + ("\n" + constraint.syntax.trigger if i % 2 else "")
        elif choice == "auto":  # a call opens the output (every other time), else free text
            prefix = constraint.syntax.open + constraint.syntax.head("search") if i % 2 else "Let me"
        text, done = walk(grammar, tok, rng, prefix)
        if not done:
            continue
        ended += 1
        calls += len(check_calls(fmt, text, constraint.syntax, c, rng))
    assert ended >= 8 and calls >= 4, (ended, calls)


def test_parallel_false_allows_one_call(tokenizers, backends):
    tok = tokenizers[()]
    for fmt in ("hermes", "qwen3_xml"):
        constraint = tool_call_grammar(fmt, TOOLS, "required", False)
        m = backends[()].get(constraint.grammar).matcher()
        head = constraint.syntax.head("now")
        one = head + ("{}" if fmt == "hermes" else "") + constraint.syntax.tail
        assert m.accept(tok.encode(one, add_special_tokens=False))
        assert m.accept([tok.eos_token_id])
        m = backends[()].get(constraint.grammar).matcher()
        assert not m.accept(tok.encode(one + "\n" + head, add_special_tokens=False))


def test_formats_without_a_syntax_refuse_required():
    with pytest.raises(ValueError, match="cannot be enforced"):
        tool_call_grammar("glm", TOOLS, "required")
    assert tool_call_grammar("glm", TOOLS, "auto") is None
    with pytest.raises(ValueError, match="function name"):
        tool_call_grammar("hermes", [{"type": "function", "function": {"name": "a b"}}], "required")


def test_streamed_call_opens_before_its_arguments_end():
    """Under a grammar the id and name go out with the head, the arguments as they come; a call cut
    by max_tokens after it opened is not among the complete calls."""
    constraint = tool_call_grammar("hermes", TOOLS, "required")
    s = ToolCallStream("hermes", TOOLS, constraint.syntax)
    head = constraint.syntax.head("get_weather")
    assert s.feed(head[:-3]) == []
    (opened,) = s.feed(head[-3:])
    assert opened.id is not None and opened.name == "get_weather" and opened.arguments == ""
    (frag,) = s.feed('{"city": "Pa')
    assert frag.id is None and frag.arguments == '{"city": "Pa'
    assert [d.arguments for d in s.feed('ris"}')] == ['ris"}']
    assert s.feed("}\n</tool_call>") == [] and [c.arguments for c in s.calls] == ['{"city": "Paris"}']
    cut = ToolCallStream("hermes", TOOLS, constraint.syntax)
    cut.feed(head + '{"city": "Pa')
    assert cut.finish(truncated=True) == [] and cut.calls == [] and cut.dropped
    # the next call's opener cut short by max_tokens is markup too, not content
    whole = head + '{"city": "Paris"}}\n</tool_call>'
    got = parse(whole + "\n<tool_", TOOLS, format="hermes", truncated=True, syntax=constraint.syntax)
    assert got.content is None and [c.name for c in got.tool_calls] == ["get_weather"]
    # text that leaves the layout (possible only without the grammar): before a call opens it is
    # content, as the format's parser would say; after, the call is abandoned (its start was sent)
    text = "<tool_call>\nnot a call"
    s = ToolCallStream("hermes", TOOLS, constraint.syntax)
    got = collect(s.feed(text) + s.finish())
    assert got.content == text and not got.tool_calls and not s.calls
    s = ToolCallStream("hermes", TOOLS, constraint.syntax)
    out = s.feed(head + "[1, 2]}\n</tool_call> after")
    assert [d.name for d in out if isinstance(d, ToolCallDelta)] == ["get_weather"]
    assert s.finish() == [] and s.calls == [] and s.dropped
    xml = tool_call_grammar("qwen3_xml", TOOLS, "required").syntax
    s = ToolCallStream("qwen3_xml", TOOLS, xml)
    out = s.feed(xml.head("get_weather") + "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n")
    assert [d.arguments for d in out] == ["", '{"city": "Paris"']
    assert [d.arguments for d in s.feed("</parameter>\n")] == [', "days": 3']
    assert [d.arguments for d in s.feed("</function>\n</tool_call>")] == ["}"]
    assert json.loads(s.calls[0].arguments) == {"city": "Paris", "days": 3}


@pytest.fixture(scope="module")
def models():
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import save_tiny_text_model

    out = {}
    for specials in ([], SPECIALS, PY):
        path = save_tiny_text_model(tempfile.mkdtemp(), specials=specials)
        out[tuple(specials)] = LLM(path, dtype="float32", num_blocks=512, block_size=16, max_num_seqs=16)
    return out


@pytest.mark.parametrize("fmt,specials", [c for c in CASES if c[1] != ["[TOOL_CALLS]"]], ids=lambda x: str(x))
def test_engine_outputs_under_tool_grammars(models, fmt, specials):
    """Required and named choices on a tiny random model at temperature 1: every output ends with
    complete calls that validate, streamed (token by token, through ChoiceOutput) as whole."""
    from tests.test_structured_outputs import assert_idle, closing_bias_ids

    llm = models[tuple(specials)]
    special = {s: llm.tokenizer.convert_tokens_to_ids(s) for s in specials}
    for choice in ("required", NAMED):
        constraint = tool_call_grammar(fmt, TOOLS, choice, True, special)
        bias = closing_bias_ids(llm.tokenizer)
        bias[llm.tokenizer.eos_token_id] = 6  # allowed only where the grammar may end
        if fmt == "qwen3_xml":  # an XML value ends at a newline
            bias[llm.tokenizer.encode("\n", add_special_tokens=False)[0]] = 4
        params = [
            SamplingParams(
                temperature=1.0, seed=s, max_tokens=1000, structured=constraint.grammar, logit_bias=bias,
                keep_special_token_ids=tuple(special.values()),
            )
            for s in range(6)
        ]  # fmt: skip
        outs = llm.generate(["call a tool"] * len(params), params)
        plan = OutputPlan(tool_format=fmt, tools=TOOLS, tool_syntax=constraint.syntax)
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason.value == "stop", (c.finish_reason, c.text)
            calls = check_calls(fmt, c.text, constraint.syntax, choice, random.Random(0))
            streamed, whole = ChoiceOutput(plan), ChoiceOutput(plan)
            deltas, sent = [], ""
            ids = [t for t in c.token_ids if t != llm.tokenizer.eos_token_id]
            for i in range(1, len(ids) + 1):  # token by token, whole characters only
                text = llm.tokenizer.decode(ids[:i], skip_special_tokens=False)
                if not text.endswith("\ufffd"):
                    deltas += streamed.feed(text[len(sent) :])
                    sent = text
            assert sent == c.text
            deltas += streamed.finish()
            deltas = [d.to_openai() for d in deltas]  # OpenAI's fragments
            whole.feed(c.text)
            whole.finish()
            assert [d for d in deltas if "tool_calls" in d][0]["tool_calls"][0]["function"]["arguments"] == ""
            assert [(x.name, x.arguments) for x in streamed.calls] == [(x.name, x.arguments) for x in calls]
            assert whole.message()["tool_calls"] == [
                {"id": x.id, "type": "function", "function": {"name": x.name, "arguments": x.arguments}}
                for x in whole.calls
            ]
        assert_idle(llm)
