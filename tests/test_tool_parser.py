"""Tool-call parsers (foveal.parsing.tools) against the CanIToolCall fixtures, plus invariants.

The fixtures (../shared/heldout/canitoolcall, read in place, never copied) are replayed for the
families qwen3-hermes, qwen3-xml, llama (JSON and pythonic), mistral, glm, deepseek (V3/V3.1 and
DSML), kimi (K2; K3's XTML is not implemented and its fixtures are counted as unsupported) and
gemma4, and gpt-oss's Harmony output (foveal.parsing.harmony: reasoning, content and calls in one
parser, so its fixtures replay the whole raw output through it). Every
family of the data is one of these (a new one fails test_fixture_counts). Following its spec/README:
`expected` (content and reasoning strict, "" = null; soft-v1 equality reported apart; arguments as
parsed JSON with types) or `expected_error` (the outcome must be in `accept`); no marker leaks; every
stream equals the non-streamed parse; all chunkings agree; truncated fixtures finish as "length".

Adaptation: the fixtures' token ids need the models' tokenizers, which cannot be downloaded here, so
we replay `raw_output` TEXT: once whole (non-streamed), then streamed per character, in seeded random
chunks, and split at every marker with the markers kept whole (what token-level streaming of special
tokens looks like), also with random chunks between markers. A leading reasoning block (`<think>`,
`[THINK]`, `<|channel>thought`, or the one the prompt opened when `generation_prompt` ends with
`<think>`) is split off first by the minimal `split_reasoning` below (reasoning is another parser's
job; `test_reasoning_parser_splits_like_the_stand_in` checks foveal.parsing.reasoning agrees); only
the rest is streamed, and `reasoning_content` is compared too. Soft passes (equal only after
stripping whitespace, spec "soft-v1") are allowed and counted apart.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from functools import cache

import pytest

from foveal.parsing import harmony
from foveal.parsing.tool_formats.values import coerce
from foveal.parsing.tools import (
    FORMATS,
    ContentDelta,
    ToolCallDelta,
    ToolCallStream,
    collect,
    detect,
    get_format,
    parse,
)
from tests.heldout import HELDOUT

ROOT = HELDOUT / "canitoolcall" / "fixtures"
FAMILIES = ("qwen3-hermes", "qwen3-xml", "llama", "mistral", "glm", "deepseek", "kimi", "gemma4", "gpt-oss")

# Fixtures we knowingly fail, id -> why. The test fails on any other failure, and on a listed
# fixture that passes (remove it then).
KNOWN_FAILURES: dict[str, str] = {}
# Fixtures of a format we do not implement: counted apart, not run.
UNSUPPORTED_TAGS = {"x-kimi-k3": "Kimi K3 XTML (<|open|>tools<|sep|>...) is not implemented"}
UNSUPPORTED_FAMILIES: dict[str, str] = {}


def load_fixtures() -> list[dict]:
    out = []
    for family in FAMILIES:
        markers = json.loads((ROOT / family / "family.json").read_text())["markers"]
        for path in sorted((ROOT / family).glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    fx = json.loads(line)
                    fx["_markers"] = markers
                    out.append(fx)
    return out


FIXTURES = load_fixtures() if ROOT.is_dir() else []


def unsupported(fx: dict) -> str | None:
    if why := UNSUPPORTED_FAMILIES.get(fx["family"]):
        return why
    return next((why for tag, why in UNSUPPORTED_TAGS.items() if tag in fx["tags"]), None)


def format_of(fx: dict) -> str:
    family, tags = fx["family"], fx["tags"]
    if family == "llama":
        return "pythonic" if "x-llama-pythonic" in tags else "llama3_json"
    if family == "deepseek":
        return "deepseek_v3" if {"x-deepseek-v3", "x-deepseek-v31"} & set(tags) else "deepseek_dsml"
    return {"qwen3-hermes": "hermes", "qwen3-xml": "qwen3_xml", "kimi": "kimi_k2"}.get(family, family)


# family -> the think-marker pairs its output may start with
THINK_PAIRS = {
    "mistral": [("[THINK]", "[/THINK]"), ("<think>", "</think>")],
    "gemma4": [("<|channel>thought", "<channel|>")],
    "llama": [],
    "kimi": [],
}


def prompt_opened_thinking(fx: dict) -> bool:
    if fx["family"] == "glm":  # GLM-4.7+ templates open <think>; the fixtures record no prompt
        return "x-glm47" in fx["tags"] and fx.get("thinking") is not False
    return (fx.get("generation_prompt") or "").rstrip().endswith("<think>")


def split_reasoning(fx: dict) -> tuple[str | None, str]:
    """(reasoning, rest): a minimal stand-in for the reasoning parser, enough for these fixtures."""
    text = fx["raw_output"]
    for open_, close in THINK_PAIRS.get(fx["family"], [("<think>", "</think>")]):
        if text.lstrip().startswith(open_):
            return _split_at(fx, text.index(open_) + len(open_), close)
    if fx["family"] in ("qwen3-hermes", "qwen3-xml", "glm", "deepseek") and prompt_opened_thinking(fx):
        return _split_at(fx, 0, "</think>")
    return None, text


def _split_at(fx: dict, start: int, close: str) -> tuple[str | None, str]:
    text = fx["raw_output"]
    end = text.find(close, start)
    if end >= 0:
        return text[start:end].strip() or None, text[end + len(close) :].lstrip()
    # no close: a tool call ends the reasoning (llama.cpp's rule), else it is all reasoning
    hits = [i for t in get_format(format_of(fx)).markers.triggers if (i := text.find(t, start)) >= 0]
    end = min(hits, default=len(text))
    return text[start:end].strip() or None, text[end:]


def chunkings(text: str, markers: list[str]) -> dict[str, list[str]]:
    pattern = "(" + "|".join(re.escape(m) for m in sorted(set(markers), key=len, reverse=True)) + ")"
    pieces = [p for p in re.split(pattern, text) if p]

    def rand(seed: int, hi: int, parts: list[str]) -> list[str]:
        rng, out = random.Random(seed), []
        for part in parts:
            if part in markers:
                out.append(part)
                continue
            i = 0
            while i < len(part):
                k = rng.randint(1, hi)
                out.append(part[i : i + k])
                i += k
        return out

    out = {"one": [text], "char": list(text), "special": pieces}
    for seed in (1, 2, 3, 4, 5):
        out[f"rand:{seed}:8"] = rand(seed, 8, [text])
    out["rand:6:40"] = rand(6, 40, [text])
    for seed in (1, 2, 3):
        out[f"special+rand:{seed}:6"] = rand(seed, 6, pieces)
    return out


def stream(fmt: str, tools, chunks: list[str], truncated: bool):
    s = ToolCallStream(fmt, tools)
    deltas = []
    for c in chunks:
        deltas += s.feed(c)
    deltas += s.finish(truncated)
    return deltas


def same_json(a, b) -> bool:
    """JSON equality where types matter (True != 1) but 1 == 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def strings_of(v):
    if isinstance(v, str):
        yield v
    elif isinstance(v, list):
        for x in v:
            yield from strings_of(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            yield k
            yield from strings_of(x)


def check_deltas(deltas) -> list[str]:
    """OpenAI delta shape: per call the first delta has id, type, name; then argument pieces."""
    problems, seen = [], {}
    for d in deltas:
        if isinstance(d, ContentDelta):
            if not d.text:
                problems.append("empty content delta")
            continue
        o = d.to_openai()["tool_calls"][0]
        if d.index not in seen:
            if d.index != len(seen) or d.id is None or o.get("type") != "function" or not d.name:
                problems.append(f"call {d.index} does not start with index/id/type/name: {o}")
            seen[d.index] = ""
        elif d.id is not None or d.name is not None:
            problems.append(f"call {d.index} repeats id/name")
        seen[d.index] += d.arguments
    for i, args in seen.items():
        try:
            if not isinstance(json.loads(args), dict):
                problems.append(f"call {i} arguments are not an object")
        except ValueError:
            problems.append(f"call {i} arguments are not JSON: {args[:80]!r}")
    ids = [d.id for d in deltas if isinstance(d, ToolCallDelta) and d.id is not None]
    if len(set(ids)) != len(ids) or not all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids):
        problems.append(f"bad or repeated ids {ids}")
    return problems


def view(result) -> tuple:
    return result.content, [(c.name, c.arguments) for c in result.tool_calls]


def replay_harmony(fx: dict, markers: list[str], problems: list[str]):
    """gpt-oss: the Harmony parser takes the whole output (reasoning, content and calls are one
    sequence of messages); every chunking's deltas, joined, equal the whole parse."""
    truncated = "truncated" in fx["tags"]
    reasoning, result = harmony.parse(fx["raw_output"], truncated)
    for name, chunks in chunkings(fx["raw_output"], markers).items():
        s = harmony.HarmonyStream()
        deltas = [d for c in chunks for d in s.feed(c)] + s.finish(truncated)
        thought = "".join(d.text for d in deltas if isinstance(d, harmony.ReasoningDelta)) or None
        deltas = [d for d in deltas if not isinstance(d, harmony.ReasoningDelta)]
        problems += [f"{name}: {p}" for p in check_deltas(deltas)]
        if (thought, view(collect(deltas))) != (reasoning, view(result)):
            got, want = (thought, view(collect(deltas))), (reasoning, view(result))
            problems.append(f"{name}: stream {got} != nonstream {want}")
    return reasoning, fx["raw_output"], result


@cache
def run_fixture(index: int) -> tuple[str, list[str]]:
    """('pass' | 'soft_pass' | 'fail', problems) for one fixture."""
    fx = FIXTURES[index]
    problems: list[str] = []
    if fx["family"] == "gpt-oss":
        markers = list(dict.fromkeys(fx["_markers"] + list(harmony.MARKERS)))
        reasoning, rest, result = replay_harmony(fx, markers, problems)
    else:
        fmt, tools, truncated = format_of(fx), fx["tools"], "truncated" in fx["tags"]
        reasoning, rest = split_reasoning(fx)
        markers = list(dict.fromkeys(fx["_markers"] + list(get_format(fmt).markers.markup)))
        result = parse(rest, tools, format=fmt, truncated=truncated)
        for name, chunks in chunkings(rest, markers).items():
            deltas = stream(fmt, tools, chunks, truncated)
            problems += [f"{name}: {p}" for p in check_deltas(deltas)]
            if view(collect(deltas)) != view(result):
                problems.append(f"{name}: stream {view(collect(deltas))} != nonstream {view(result)}")
    status = "pass"
    if "expected" in fx:
        exp = fx["expected"]
        for field, got, want in (
            ("content", result.content, exp.get("content")),
            ("reasoning", reasoning, exp.get("reasoning_content")),
        ):
            got, want = got or None, want or None
            if got != want:
                if (got or "").strip() == (want or "").strip():
                    status = "soft_pass"
                else:
                    problems.append(f"{field} {got!r} != {want!r}")
        calls, want_calls = result.tool_calls, exp["tool_calls"]
        if [c.name for c in calls] != [c["name"] for c in want_calls]:
            problems.append(f"calls {[c.name for c in calls]} != {[c['name'] for c in want_calls]}")
        else:
            for c, w in zip(calls, want_calls):
                if not same_json(json.loads(c.arguments), w["arguments"]):
                    problems.append(f"{c.name} arguments {c.arguments} != {json.dumps(w['arguments'])}")
        allowed = json.dumps(exp, ensure_ascii=False)
        texts = [result.content or ""] + [c.name for c in calls]
        texts += [s for c in calls for s in strings_of(json.loads(c.arguments))]
        for m in markers:
            if any(m in t for t in texts) and m not in allowed:
                problems.append(f"marker {m!r} leaked")
    else:
        accept = fx["expected_error"]["accept"]
        outcomes = set()
        if not result.tool_calls:
            outcomes.add("no_tool_calls")
            if (result.content or "") == rest:
                outcomes.add("content_passthrough")
        if not outcomes & set(accept):
            problems.append(f"outcome {view(result)} not in {accept}")
    return ("fail" if problems else status), problems


IDS = [fx["id"] for fx in FIXTURES]


@pytest.mark.skipif(not FIXTURES, reason="../shared/heldout/canitoolcall is not here")
@pytest.mark.parametrize("index", range(len(FIXTURES)), ids=IDS)
def test_fixture(index):
    if why := unsupported(FIXTURES[index]):
        pytest.skip(why)
    status, problems = run_fixture(index)
    fid = FIXTURES[index]["id"]
    if fid in KNOWN_FAILURES:
        assert status == "fail", f"{fid} passes now: remove it from KNOWN_FAILURES"
    else:
        assert status != "fail", "\n".join(problems)


@pytest.mark.skipif(not FIXTURES, reason="../shared/heldout/canitoolcall is not here")
def test_fixture_counts(capsys):
    counts: dict[str, Counter] = {}
    for i, fx in enumerate(FIXTURES):
        status = "unsupported" if unsupported(fx) else run_fixture(i)[0]
        counts.setdefault(fx["family"], Counter())[status] += 1
    with capsys.disabled():
        print("\ntool-call fixtures (text replay):")
        for family, c in counts.items():
            print(
                f"  {family:13s} {c['pass']:3d} pass  {c['soft_pass']:2d} soft_pass  {c['fail']:2d} fail  "
                f"{c['unsupported']:2d} unsupported  / {sum(c.values())}"
            )
    assert set(counts) == set(FAMILIES) and all(sum(c.values()) for c in counts.values())
    # no family of the data is left out of both the replay and the unsupported count
    assert {p.name for p in ROOT.iterdir() if p.is_dir()} == set(FAMILIES)


# ---- beyond the fixtures -----------------------------------------------------------------------

CUT_TEXTS = [  # (format, complete output with calls)
    (
        "hermes",
        'Sure.\n<tool_call>\n{"name": "a", "arguments": {"s": "x</tool_call>y", "n": 1}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
    ),
    (
        "qwen3_xml",
        "<tool_call>\n<function=a>\n<parameter=n>\n12\n</parameter>\n<parameter=s>\nrm -rf /tmp"
        "/x\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=b>\n</function>\n"
        "</tool_call>",
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"n": 12, "s": "}{"}}; {"name": "b", "parameters": {}}',
    ),
    ("mistral", 'Ok[TOOL_CALLS]a[ARGS]{"n": 12, "s": "rm -rf /tmp/x"}[TOOL_CALLS]b[CALL_ID]7[ARGS]{}'),
    ("mistral", '[TOOL_CALLS] [{"name": "a", "arguments": {"n": 12}}, {"name": "b", "arguments": {}}]'),
    ("pythonic", "[a(n=12, s='rm -rf /tmp/x', t=(1, 2)), b()]"),
    (
        "glm",
        "<tool_call>a\n<arg_key>n</arg_key>\n<arg_value>12</arg_value>\n<arg_key>s</arg_key>\n"
        "<arg_value>rm -rf /tmp/x</arg_value>\n</tool_call>\n<tool_call>b\n</tool_call>",
    ),
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n"
        '{"n": 12, "s": "rm -rf /tmp/x"}\n```<｜tool▁call▁end｜>\n'
        "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    (
        "deepseek_dsml",
        '\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="a">\n<｜DSML｜parameter name="n" string="false">'
        '12</｜DSML｜parameter>\n<｜DSML｜parameter name="s" string="true">rm -rf /tmp/x</｜DSML｜parameter>'
        '\n</｜DSML｜invoke>\n<｜DSML｜invoke name="b"/>\n</｜DSML｜function_calls>',
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.a:0<|tool_call_argument_begin|>"
        '{"n": 12, "s": "rm -rf /tmp/x"}<|tool_call_end|><|tool_call_begin|>functions.b:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
    ),
    (
        "gemma4",
        '<|tool_call>call:a{n:12,s:<|"|>rm -rf /tmp/x}<|"|>}<tool_call|><|tool_call>call:b{}<tool_call|>',
    ),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "a",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}, "s": {"type": "string"}},
            },
        },
    }
]


@pytest.mark.parametrize("fmt,text", CUT_TEXTS)
def test_cut_anywhere_never_yields_a_partial_call(fmt, text):
    """max_tokens can cut at any character: the calls then are always complete calls of the full
    output (a prefix of its call list), never a shortened one; and the stream never sent more."""
    full = view(parse(text, TOOLS, format=fmt))[1]
    assert [n for n, _ in full] == ["a", "b"]
    for k in range(len(text)):
        calls = view(parse(text[:k], TOOLS, format=fmt, truncated=True))[1]
        assert calls == full[: len(calls)], (k, text[:k])
        s = ToolCallStream(fmt, TOOLS)
        sent = [d for d in s.feed(text[:k]) if isinstance(d, ToolCallDelta) and d.name]
        assert [d.name for d in sent] == [n for n, _ in full][: len(sent)]


@pytest.mark.skipif(not FIXTURES, reason="../shared/heldout/canitoolcall is not here")
def test_mangled_outputs_stream_like_they_parse():
    """Fixture outputs with random edits (deleted / inserted characters and markers, swaps), streamed
    in random chunks, truncated or not: never an exception, always the one-shot result, arguments
    always a JSON object. Guards split invariance where well-formed fixtures cannot reach."""
    rng = random.Random(1234)
    cases = [fx for fx in FIXTURES if not unsupported(fx)]
    noise = list("\"{}[]<>\n ,:'()\\x1")
    for _ in range(1500):
        fx = rng.choice(cases)
        fmt = None if fx["family"] == "gpt-oss" else format_of(fx)
        chars = list(fx["raw_output"] if fmt is None else split_reasoning(fx)[1])
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(len(chars) + 1)
            op = rng.random()
            if op < 0.3 and i < len(chars):
                del chars[i]
            elif op < 0.8:
                chars.insert(i, rng.choice(noise if op < 0.6 else fx["_markers"]))
            elif chars:
                j = rng.randrange(len(chars))
                chars[min(i, len(chars) - 1)], chars[j] = chars[j], chars[min(i, len(chars) - 1)]
        text, truncated = "".join(chars), rng.random() < 0.3
        sizes = rng.choice([1, 3, 12])
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, sizes)
            chunks.append(text[i : i + k])
            i += k
        if fx["family"] == "gpt-oss":  # Harmony: reasoning too, from the one parser
            thought, result = harmony.parse(text, truncated)
            s = harmony.HarmonyStream()
            deltas = [d for c in chunks for d in s.feed(c)] + s.finish(truncated)
            got = "".join(d.text for d in deltas if isinstance(d, harmony.ReasoningDelta)) or None
            deltas = [d for d in deltas if not isinstance(d, harmony.ReasoningDelta)]
            assert (got, view(collect(deltas))) == (thought, view(result)), (fx["id"], text)
        else:
            want = view(parse(text, fx["tools"], format=fmt, truncated=truncated))
            deltas = stream(fmt, fx["tools"], chunks, truncated)
            assert view(collect(deltas)) == want, (fx["id"], text)
        assert not check_deltas(deltas), (fx["id"], text)


def test_markup_is_held_back_but_content_is_not():
    s = ToolCallStream("hermes")
    assert [d.to_openai() for d in s.feed("Hello wor")] == [{"content": "Hello wor"}]
    assert [d.to_openai() for d in s.feed("ld <tool")] == [{"content": "ld"}]  # " <tool" may be markup
    assert s.feed("_call>") == []
    deltas = s.feed('{"name": "f", "arguments": {"a": 1}}</tool_call>')
    o = [d.to_openai() for d in deltas]
    assert o[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert o[0]["tool_calls"][0]["type"] == "function" and o[0]["tool_calls"][0]["index"] == 0
    assert o[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1}'}}]}
    assert s.finish() == [] and s.has_calls
    s = ToolCallStream("hermes")
    assert collect(s.feed("a <tool") + s.finish()).content == "a <tool"  # no call came: it was text


def test_policies():
    hermes = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\nDone.'
    assert view(parse(hermes, format="hermes")) == ("Let me check.\nDone.", [("f", '{"a": 1}')])
    cut = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a":'
    assert view(parse(cut, format="hermes", truncated=True)) == ("Let me check.", [])
    assert view(parse(cut, format="hermes")) == (cut, [])  # a natural stop: malformed, passthrough
    unclosed = '<tool_call>\n{"name": "f", "arguments": {}}'
    assert view(parse(unclosed, format="hermes"))[1] == [("f", "{}")]  # the stop token closes it
    assert view(parse(unclosed, format="hermes", truncated=True))[1] == []
    # unknown tool names are kept as calls
    assert view(parse('[TOOL_CALLS]nope[ARGS]{"x": 1}', TOOLS, format="mistral"))[1] == [("nope", '{"x": 1}')]
    # text before a call keeps its space where the template writes no separator
    assert (
        parse('Let me check. <|python_tag|>{"name": "a", "parameters": {}}', format="llama3_json").content
        == "Let me check. "
    )
    # a broken call does not hide a good one after it
    two = '<tool_call>{"name": broken}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert view(parse(two, format="hermes")) == ('<tool_call>{"name": broken}</tool_call>', [("g", "{}")])


def test_pythonic_is_never_evaluated():
    for text in (
        "[f(a=__import__('os').system('echo x'))]",
        "[f(a=1+2)]",
        "[f(x)]",
        "[f(**k)]",
        "[f(a=float('nan'))]",
        "[f(a={1, 2})]",
    ):
        assert view(parse(text, format="pythonic")) == (text, []), text
    assert view(parse("[f(a=-1.5, b=None, c=(1, 'x'))]", format="pythonic"))[1] == [
        ("f", '{"a": -1.5, "b": null, "c": [1, "x"]}')
    ]
    assert parse("[1] Smith et al.", format="pythonic").content == "[1] Smith et al."


def test_ids_unique_and_shaped():
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{}}}}</tool_call>' for i in range(200))
    calls = parse(text, format="hermes").tool_calls
    assert len(calls) == 200 and len({c.id for c in calls}) == 200
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)


def test_qwen_xml_value_typing():
    assert coerce("5", {"type": "integer"}) == 5 and coerce("5", {"type": "string"}) == "5"
    assert coerce("0.5", {"type": "number"}) == 0.5 and coerce("True", {"type": "boolean"}) is True
    assert coerce("null", {"type": ["string", "null"]}) is None
    assert coerce("{'a': None}", {"type": "object"}) == {"a": None}
    assert coerce("[1]", {"anyOf": [{"type": "array"}, {"type": "null"}]}) == [1]
    assert coerce("abc", {"type": "integer"}) == "abc"  # fits no type: the text as it came
    assert coerce('{"a": 1}', None) == {"a": 1} and coerce("7", None) == "7"


def test_detect_and_names():
    assert detect("...[TOOL_CALLS]...") is FORMATS["mistral"]
    assert detect(None, {"[TOOL_CALLS]": 9}) is FORMATS["mistral"]
    assert detect("<tool_call>\n<function=...>\n<parameter=...>") is FORMATS["qwen3_xml"]
    assert (
        detect('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
        is FORMATS["hermes"]
    )
    assert (
        detect("Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]")
        is FORMATS["pythonic"]
    )
    assert detect("{%- if tools %}{{- '<|python_tag|>' }}") is FORMATS["llama3_json"]
    assert (
        detect(
            'Respond in the format {"name": function name, "parameters": dictionary of argument '
            "name and its value}."
        )
        is FORMATS["llama3_json"]
    )
    assert detect("{{ bos_token }}{{ message.content }}", ["<s>", "</s>"]) is None
    assert detect("", ["<tool_call>", "</tool_call>"]) is FORMATS["hermes"]
    assert detect(None, {"<｜tool▁calls▁begin｜>": 1}) is FORMATS["deepseek_v3"]
    assert detect(None, ["<｜tool▁calls▁begin｜>", "｜DSML｜"]) is FORMATS["deepseek_dsml"]
    assert detect("{{- '<|tool_calls_section_begin|>' }}") is FORMATS["kimi_k2"]
    assert detect("{{- '<|tool_call>call:' + name }}") is FORMATS["gemma4"]
    assert detect("<tool_call>{{ name }}\n<arg_key>{{ k }}</arg_key>") is FORMATS["glm"]
    assert get_format("qwen3_coder") is FORMATS["qwen3_xml"]
    assert get_format("llama4_pythonic").name == "pythonic"
    with pytest.raises(ValueError):
        get_format("nope")
    for f in FORMATS.values():  # the grammar trigger data
        assert f.markers.triggers or f.markers.start_triggers
        assert all(t in f.markers.markup for t in f.markers.triggers)


@pytest.mark.skipif(not FIXTURES, reason="../shared/heldout/canitoolcall is not here")
def test_reasoning_parser_splits_like_the_stand_in():
    """The pipeline as the server will run it: foveal.parsing.reasoning first, then the tool parser.
    Where it splits every fixture as `split_reasoning` does, the fixture results above carry over."""
    reasoning = pytest.importorskip("foveal.parsing.reasoning")
    for fx in FIXTURES:
        fmt = {"glm": "think", "deepseek": "deepseek_r1", "gemma4": "gemma4"}.get(fx["family"])
        if fx["family"].startswith("qwen3"):
            fmt = "qwen3"
        elif fx["family"] == "mistral":
            fmt = "think" if "x-think-text" in fx["tags"] else "mistral"
        if fmt is None or unsupported(fx):
            continue
        r, c = reasoning.parse(
            fx["raw_output"],
            fmt,
            thinking=fx.get("thinking") is not False,
            prompt_opened=prompt_opened_thinking(fx),
        )
        assert (r, c or "") == split_reasoning(fx), fx["id"]
