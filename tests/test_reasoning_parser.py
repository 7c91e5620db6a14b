"""The reasoning parser (foveal/parsing/reasoning.py) against vLLM's recorded vectors, the reasoning
parts of the canitoolcall fixtures, and its own invariants: split invariance under any chunking,
partial markers held back, detect() on vocabularies, prompt_opens_thinking() on rendered prompts.
The held-out data is read in place (../shared/heldout, see its README); it is never copied here."""

from __future__ import annotations

import json
import random
import re

import pytest

from foveal.parsing.reasoning import (
    FORMATS,
    ReasoningParser,
    detect,
    get_format,
    parse,
    prompt_opens_thinking,
)
from tests.heldout import HELDOUT

VECTORS = HELDOUT / "vllm-reasoning" / "reasoning_vectors.jsonl"
FIXTURES = HELDOUT / "canitoolcall" / "fixtures"
needs_vectors = pytest.mark.skipif(not VECTORS.is_file(), reason="held-out vectors absent")
needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason="held-out fixtures absent")


def _none(s: str) -> str | None:
    return s or None


def stream(text_chunks, fmt, **kw) -> tuple[str | None, str | None]:
    p = ReasoningParser(fmt, **kw)
    r, c = [], []
    for chunk in text_chunks:
        dr, dc = p.feed(chunk)
        r.append(dr)
        c.append(dc)
    dr, dc = p.finish()
    return _none("".join(r) + dr), _none("".join(c) + dc)


# every marker any format knows, for the "special" chunking (each marker its own delta)
_MARKERS = sorted(
    {m for f in FORMATS.values() for m in (f.start, f.end, *f.tokens, *(o for o, _ in f.implicit_ends))},
    key=len,
    reverse=True,
)
_MARKER_RE = re.compile("(" + "|".join(map(re.escape, _MARKERS)) + ")")


def chunkings(text: str, extra=()):
    """Whole, per character, each marker its own delta, seeded random sizes, every two-piece split
    (so at and inside every marker) with an empty delta between the pieces, and any recorded deltas."""
    yield "whole", [text]
    yield "char", list(text)
    yield "special", [p for p in _MARKER_RE.split(text) if p]
    for seed in range(5):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 8)
            pieces.append(text[i : i + n])
            i += n
        yield f"rand:{seed}", pieces
    for i in range(len(text) + 1):
        yield f"split:{i}", [text[:i], "", text[i:]]
    for name, pieces in extra:
        yield name, pieces


# ---------------------------------------------------------------- vLLM's vectors

_TOOL = (
    "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n"
    + "</tool_call>"
)
_READ = "I need to read the file."
# Vectors where our documented policy (module docstring) differs from vLLM's on purpose, keyed
# "parser/id", with OUR result. Every other vector must match vLLM exactly.
DELIBERATE: dict[str, tuple[str | None, str | None]] = {
    # Rule 6 ("" vs None): vLLM's non-streamed deepseek_r1 path returns reasoning "" where its
    # streamed path returns None for the same output; we return None in both.
    "deepseek_r1/shortest_streaming": (None, "This is the rest"),  # "</think>This is the rest"
    "deepseek_r1/shortest_with_think": (None, "This is the rest"),
    "deepseek_r1/empty": (None, None),  # empty output
    # Rule 4 (separator newlines): the "\n" right after </think> is not content (vLLM keeps it).
    "deepseek_r1/new_line": ("This is a reasoning section", "This is the rest"),
    # Same output streamed: vLLM also keeps the "\n" before <think> as reasoning (its non-stream path
    # drops it); for us it is a leading newline of the block, a separator.
    "deepseek_r1/new_line_streaming": ("This is a reasoning section", "This is the rest"),
    # Rule 4: the "\n\n" before an implicit <tool_call> end is a separator (vLLM keeps it in reasoning;
    # the canitoolcall fixture qwen3-xml/llamacpp-q35-call-inside-think expects it dropped).
    "qwen3/tool_call_no_think_end": (_READ, _TOOL),
    "qwen3/tool_call_no_think_end_stream": (_READ, _TOOL),
    "qwen3/tool_call_with_think_no_end": (_READ, _TOOL),
    "qwen3/tool_call_with_think_no_end_stream": (_READ, _TOOL),
    "qwen3/tool_call_implicit_reasoning_end": (_READ, "<tool_call>\n<function=bash>"),
}


def _vectors() -> list[dict]:
    if not VECTORS.is_file():
        return []
    return [json.loads(line) for line in VECTORS.read_text().splitlines() if line.strip()]


def _key(v: dict) -> str:
    return f"{v['parser']}/{v['id']}"


@needs_vectors
def test_deliberate_differences_are_real():
    vectors = {_key(v): v for v in _vectors()}
    assert len(vectors) == 52
    for key, ours in DELIBERATE.items():
        v = vectors[key]  # a renamed vector must be looked at again
        assert (v["reasoning"], v["content"]) != ours, key


@needs_vectors
@pytest.mark.parametrize("v", _vectors(), ids=_key)
def test_vllm_vector(v):
    expected = DELIBERATE.get(_key(v), (v["reasoning"], v["content"]))
    kw = {"thinking": v.get("enable_thinking", True)}
    assert parse(v["output"], v["parser"], **kw) == expected
    extra = [("recorded", v["deltas"])] if "deltas" in v else []
    for name, pieces in chunkings(v["output"], extra):
        assert stream(pieces, v["parser"], **kw) == expected, name


# ---------------------------------------------------------------- canitoolcall fixtures

# Families whose reasoning is a marker pair we have (family.json markers): the format per reference
# model. Left out: gpt-oss (Harmony channels, not a pair), Kimi K3 (XTML), llama (no reasoning).
FAMILY_FORMAT = {
    "qwen3-hermes": "qwen3",
    "qwen3-xml": "qwen3",
    "deepseek": "deepseek_r1",
    "glm": "think",
    "gemma4": "gemma4",
    "kimi": "kimi_k2",
    "mistral": "mistral",
}
MODEL_FORMAT = {
    "mistralai/Magistral-Small-2506": "think",  # writes <think> as text, not [THINK]
    "moonshotai/Kimi-K3": None,  # XTML: not a format we have
}


def _fixture_cases():
    for family, fmt in FAMILY_FORMAT.items():
        meta = json.loads((FIXTURES / family / "family.json").read_text())
        refs = {m["repo"]: m for m in meta["reference_models"]}
        for path in sorted((FIXTURES / family).glob("*.jsonl")):
            for line in path.read_text().splitlines():
                fx = json.loads(line)
                model = fx["models"][0]
                yield (
                    fx,
                    MODEL_FORMAT.get(model, fmt),
                    refs[model]["default_generation_prompt"],
                    meta["markers"],
                )


@needs_fixtures
def test_canitoolcall_reasoning():
    """Reasoning equals expected.reasoning_content under the spec's strict rule ("" is null, no
    whitespace stripping: its README grades stripped-only equality soft_pass). Where no tool call is
    expected, content must match too. Tool-call markup stays in content (the tool parser's input)."""
    failures, counts = [], {"with_reasoning": 0, "without_reasoning": 0, "content": 0, "skipped": 0}
    for fx, fmt, default_prompt, markers in _fixture_cases():
        expected = fx.get("expected")
        if expected is None or fmt is None:  # expected_error fixtures judge tool calls, not reasoning
            counts["skipped"] += 1
            continue
        prompt = fx.get("generation_prompt")  # absent: the reference model's default prompt
        prompt = default_prompt if prompt is None else prompt
        kw = {
            "thinking": fx.get("thinking") is not False,
            "prompt_opened": prompt_opens_thinking(prompt, fmt),
        }
        want = expected.get("reasoning_content") or None
        counts["with_reasoning" if want else "without_reasoning"] += 1
        got = parse(fx["raw_output"], fmt, **kw)
        if got[0] != want:
            failures.append(f"{fx['id']}: reasoning {got[0]!r} != {want!r}")
        # content still holding the family's markup (a bare or empty tool-call section) is the tool
        # parser's input; its expected content is what that parser leaves
        if not expected["tool_calls"] and not any(m in (got[1] or "") for m in markers):
            counts["content"] += 1
            if got[1] != (expected.get("content") or None):
                failures.append(f"{fx['id']}: content {got[1]!r} != {expected.get('content')!r}")
        for name, pieces in chunkings(fx["raw_output"]):
            if not name.startswith("split:") and stream(pieces, fmt, **kw) != got:
                failures.append(f"{fx['id']}: stream {name} differs from one-shot")
    print(f"canitoolcall fixtures checked: {counts}")
    assert not failures, "\n".join(failures)
    assert counts["with_reasoning"] >= 100 and counts["without_reasoning"] >= 150


@needs_fixtures
def test_reference_generation_prompts():
    """prompt_opens_thinking on the generation prompts the families' official templates render."""
    want = {
        "Qwen/Qwen3-0.6B": False,  # hybrid: the model writes <think> itself
        "Qwen/Qwen3-4B-Thinking-2507": True,
        "Qwen/Qwen3-4B-Instruct-2507": False,
        "Qwen/Qwen3.5-9B": True,
        "deepseek-ai/DeepSeek-V3.1": False,  # "<｜Assistant｜></think>": thinking off by default
        "zai-org/GLM-4.5": False,
        "zai-org/GLM-4.7": True,
        "moonshotai/Kimi-K2.6": True,
        "moonshotai/Kimi-K2-Instruct-0905": False,
        "google/gemma-4-31B-it": False,  # "<|channel>thought\n<channel|>": closed
    }
    seen = {}
    for family, fmt in FAMILY_FORMAT.items():
        for m in json.loads((FIXTURES / family / "family.json").read_text())["reference_models"]:
            if m["repo"] in want:
                seen[m["repo"]] = prompt_opens_thinking(m["default_generation_prompt"], fmt)
    assert seen == want


# ---------------------------------------------------------------- our own policy and invariants


def test_partial_markers_are_held_back_never_emitted():
    p = ReasoningParser("qwen3", prompt_opened=True)
    assert p.feed("\nStep one.\n") == ("Step one.", "")  # leading newline dropped, trailing one held
    assert p.pending == "\n"
    assert p.feed("</th") == ("", "")
    assert p.pending == "\n</th" and p.in_reasoning
    assert p.feed("ink>\n\nAnswer") == ("", "Answer")
    assert p.ended and not p.in_reasoning and p.reasoning_chars == len("Step one.")
    assert p.feed(" <think>still content") == ("", " <think>still content")  # one block only
    assert p.finish() == ("", "")
    with pytest.raises(RuntimeError):
        p.feed("x")


def test_a_marker_lookalike_is_text():
    assert parse("a </thinking> b</think>c", "qwen3") == ("a </thinking> b", "c")
    assert parse("cut at </thi", "qwen3") == ("cut at </thi", None)  # held, then flushed at finish
    assert stream(list("cut at </thi"), "qwen3") == ("cut at </thi", None)


def test_output_starting_in_content():
    # the prompt did not open a block: text before the start marker is content, whitespace is dropped
    assert parse("\n\n<think>\nr\n</think>\n\nc", "think", prompt_opened=False) == ("r", "c")
    assert parse("Sure. <think>r</think>\nc", "qwen3", prompt_opened=False) == ("r", "Sure. c")
    assert parse("  plain answer", "qwen3", prompt_opened=False) == (None, "  plain answer")
    assert parse("\n", "think") == (None, "\n")  # held as a possible prefix of a block, then content
    assert parse("a</think>b", "think") == (None, "a</think>b")  # no block was opened: plain text


def test_thinking_disabled_passes_through_unless_the_prompt_opened_the_block():
    out = "<think>r</think>c"
    assert parse(out, "qwen3", thinking=False) == (None, out)
    assert parse(out, "qwen3", thinking=False, prompt_opened=False) == (None, out)
    assert parse("r</think>c", "deepseek_r1", thinking=False, prompt_opened=True) == ("r", "c")


def test_reopened_block_and_separators():
    assert parse("\n<think>\n\nr\n\n</think>\n\nc\n", "deepseek_r1") == ("r", "c\n")
    assert parse("x\n<think>\ny</think>", "qwen3", prompt_opened=True) == ("x\n\ny", None)
    assert parse("a \n b</think> c", "qwen3") == ("a \n b", " c")  # only newlines are separators


def test_implicit_ends():
    tool = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
    assert parse("plan\n" + tool, "qwen3", prompt_opened=True) == ("plan", tool)
    # a mention of <tool_call> not followed by <function is reasoning text
    assert parse("I could emit <tool_call> now</think>ok", "qwen3") == ("I could emit <tool_call> now", "ok")
    assert parse("plan\n<tool_call>\n", "qwen3") == ("plan\n<tool_call>", None)  # undecided at the cut
    p = ReasoningParser("qwen3", prompt_opened=True)
    assert p.feed("plan\n<tool_call>\n<func") == ("plan", "")
    assert p.pending == "\n<tool_call>\n<func" and p.in_reasoning  # the newline may be a separator
    assert p.feed("tion=f>") == ("", "<tool_call>\n<function=f>") and p.ended
    k2 = "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
    assert parse("<think>hm\n" + k2, "kimi_k2") == ("hm", k2)
    assert parse("x" + k2, "think", prompt_opened=True) == ("x" + k2, None)  # not a kimi_k2 opener


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_round_trips(name):
    f = FORMATS[name]
    out = f"{f.start}\nwhy\n{f.end}\n\nanswer"
    assert parse(out, name, prompt_opened=False) == ("why", "answer")
    assert parse(out, name, prompt_opened=True) == ("why", "answer")  # a re-opened block
    assert parse(f"why\n{f.end}answer", name, prompt_opened=True) == ("why", "answer")
    assert parse("answer", name, prompt_opened=False) == (None, "answer")
    assert parse("answer", name) == (("answer", None) if f.bare == "reasoning" else (None, "answer"))


def _fuzz_texts(f, rng, n):
    pieces = [f.start, f.end, f.start[:3], f.end[:4], f.end[-3:], "a", "bc", "\n", "\n\n", " ", "<", "</"]
    for opener, follow in f.implicit_ends:
        pieces += [opener, follow, follow[:3]]
    for _ in range(n):
        yield "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_split_invariance_fuzz(name):
    rng = random.Random(name)
    modes = [{}, {"prompt_opened": True}, {"prompt_opened": False}, {"thinking": False}]
    for text in _fuzz_texts(FORMATS[name], rng, 150):
        for kw in modes:
            whole = parse(text, name, **kw)
            for label, pieces in chunkings(text):
                if label.startswith("split:") and rng.random() < 0.8:
                    continue  # a sample of the two-piece splits keeps this fast
                assert stream(pieces, name, **kw) == whole, (text, kw, label)
            p = ReasoningParser(name, **kw)
            r = p.feed(text)[0] + p.finish()[0]
            assert p.reasoning_chars == len(r)


def test_thinking_budget_forcing_uses_parser_state():
    """What an engine-side forcer sees: count tokens while in_reasoning, then feed the end marker
    as if the model had written it; the rest is content."""
    p, tokens, budget, forced = ReasoningParser("qwen3", prompt_opened=True), 0, 5, False
    emitted = []
    for tok in ["Let", " me", " think", " about", " this", " more", " and", " more"]:
        if p.in_reasoning and tokens >= budget:
            emitted.append(p.feed("\n</think>\n\n"))
            forced = True
            break
        emitted.append(p.feed(tok))
        tokens += p.in_reasoning
    emitted.append(p.feed("Answer."))
    emitted.append(p.finish())
    assert forced and p.ended and not p.in_reasoning
    assert "".join(r for r, _ in emitted) == "Let me think about this"
    assert "".join(c for _, c in emitted) == "Answer."


# ---------------------------------------------------------------- detect() and prompt state


class FakeTokenizer:
    def __init__(self, vocab, added=()):
        self._vocab = {t: i for i, t in enumerate(vocab)}
        self.added_tokens_decoder = {
            1000 + i: type("Added", (), {"content": t})() for i, t in enumerate(added)
        }
        self._by_id = {i: t for t, i in self._vocab.items()} | {
            i: a.content for i, a in self.added_tokens_decoder.items()
        }

    def get_vocab(self):
        return dict(self._vocab)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self._by_id[i] for i in ids)


QWEN3 = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "a", "\n"]


@pytest.mark.parametrize(
    "vocab,name",
    [
        (QWEN3, "qwen3"),
        (
            ["<|im_start|>", "<\uff5cAssistant\uff5c>", "<\uff5cUser\uff5c>", "<think>", "</think>"],
            "deepseek_r1",
        ),
        (["<|im_assistant|>", "<think>", "</think>", "<|tool_calls_section_begin|>"], "kimi_k2"),
        (["<|assistant|>", "<think>", "</think>", "<tool_call>"], "think"),  # GLM
        (["[INST]", "[THINK]", "[/THINK]", "[TOOL_CALLS]", "<think>"], "mistral"),
        (["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"], "gemma4"),
        (["<seed:think>", "</seed:think>", "<think>", "</think>"], "seed_oss"),
        (["<|START_THINKING|>", "<|END_THINKING|>", "<|START_RESPONSE|>"], "command_r"),
        (["\u25c1think\u25b7", "\u25c1/think\u25b7"], "kimi"),
        (["<|im_start|>", "<|im_end|>", "<tool_call>"], None),  # Qwen2.5: no think markers
        (["<|im_start|>", "<think>"], None),  # half a pair
        (["<|start|>", "<|channel|>", "<|message|>"], None),  # Harmony is not a pair format
    ],
)
def test_detect(vocab, name):
    assert detect(vocab) == name  # an iterable of token strings
    assert detect({t: i for i, t in enumerate(vocab)}) == name  # a token -> id mapping
    assert detect(FakeTokenizer(vocab)) == name  # a tokenizer


def test_detect_reads_added_tokens():
    assert detect(FakeTokenizer(["<|im_start|>", "a"], added=["<think>", "</think>"])) == "qwen3"


def test_get_format_names():
    assert get_format("deepseek-r1") is FORMATS["deepseek_r1"]
    assert get_format("glm45") is FORMATS["think"]
    assert get_format(FORMATS["qwen3"]) is FORMATS["qwen3"]
    with pytest.raises(ValueError, match="known:"):
        get_format("harmony")


@pytest.mark.parametrize(
    "prompt,fmt,opened",
    [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", "qwen3", True),
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3", False),
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "qwen3", False),
        # an earlier turn's closed block does not matter, the end of the prompt does
        (
            "<|im_start|>assistant\n<think>\nold\n</think>\n\nok<|im_end|>\n<|im_start|>assistant\n<think>\n",
            "qwen3",
            True,
        ),
        ("<think>\nold\n</think>\n\nok<|im_end|>\n<|im_start|>assistant\n", "qwen3", False),
        ("<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c><think>\n", "deepseek_r1", True),
        ("<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c></think>", "deepseek_r1", False),
        ("<|turn>model\n<|channel>thought\n", "gemma4", True),
        ("<|turn>model\n<|channel>thought\n<channel|>", "gemma4", False),
        ("[INST]hi[/INST][THINK]", "mistral", True),
    ],
)
def test_prompt_opens_thinking(prompt, fmt, opened):
    assert prompt_opens_thinking(prompt, fmt) is opened


def test_prompt_opens_thinking_on_token_ids():
    tok = FakeTokenizer(QWEN3 + ["assistant", "user", "hi"])
    ids = [tok.get_vocab()[t] for t in ["<|im_start|>", "assistant", "\n", "<think>", "\n"]]
    assert prompt_opens_thinking(ids, "qwen3", tok)
    closed = ids + [tok.get_vocab()[t] for t in ["\n", "</think>", "\n"]]
    assert not prompt_opens_thinking(closed, "qwen3", tok)
    with pytest.raises(TypeError):
        prompt_opens_thinking(ids, "qwen3")


def test_on_a_real_transformers_tokenizer():
    """detect() and prompt_opens_thinking() on a real (tiny, in-memory) transformers tokenizer whose
    think markers are added special tokens, as in Qwen3's."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.models.WordLevel({"[UNK]": 0, "hi": 1, "assistant": 2, "\n": 3}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split("\n", "isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert detect(tok) is None
    tok.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]}
    )
    assert detect(tok) == "qwen3"
    opened = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    assert prompt_opens_thinking(opened, "qwen3", tok) and not prompt_opens_thinking(closed, "qwen3", tok)
