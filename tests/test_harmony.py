"""gpt-oss's Harmony output in the serving pipeline (the parser itself replays the held-out gpt-oss
fixtures in tests/test_tool_parser.py): detection from the tokenizer, the markers kept through
detokenization, and a chat choice's deltas and message."""

from __future__ import annotations

import pytest

from foveal.config import OutputConfig
from foveal.engine.input_processor import EngineInfo, InputProcessor
from foveal.parsing import harmony
from foveal.parsing.output import ChoiceOutput, OutputPlan

OUTPUT = (
    "<|channel|>analysis<|message|>Weather needs a lookup; <|call|> is not mine to write.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{"city": '
    '"Paris <|end|>"}<|call|><|start|>assistant<|channel|>final<|message|>It is sunny.'
)


def _processor(**output):
    from tests.tiny_vlm import byte_tokenizer

    tok = byte_tokenizer(list(harmony.MARKERS), "")
    info = EngineInfo("tiny", len(tok), 256, 256, frozenset({tok.eos_token_id}))
    return InputProcessor(info, tok, output=OutputConfig(**output)), tok


def test_harmony_is_detected_and_its_markers_survive_detokenization():
    proc, tok = _processor()
    assert proc.harmony and proc.reasoning is None and proc.tool_format is None
    vocab = tok.get_vocab()
    assert {vocab[m] for m in harmony.MARKERS} <= set(proc.keep_special_ids)
    named, _ = _processor(reasoning_parser="none")  # a parser named otherwise takes the output
    assert not named.harmony


def test_harmony_named_without_its_markers_is_refused():
    from tests.tiny_vlm import byte_tokenizer

    tok = byte_tokenizer([], "")
    info = EngineInfo("tiny", len(tok), 256, 256, frozenset({tok.eos_token_id}))
    with pytest.raises(ValueError, match="Harmony"):
        InputProcessor(info, tok, output=OutputConfig(tool_call_parser="harmony"))


@pytest.mark.parametrize("size", [1, 3, 7, len(OUTPUT)])
def test_a_chat_choice_streams_reasoning_content_and_calls(size):
    out = ChoiceOutput(OutputPlan(harmony=True))
    events = []
    for i in range(0, len(OUTPUT), size):
        events += out.feed(OUTPUT[i : i + size])
    events += out.finish()
    deltas = [e.to_openai() for e in events]  # as the OpenAI chat stream sends them
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert reasoning == "Weather needs a lookup; <|call|> is not mine to write."
    assert content == "Checking.It is sunny."
    want = {"name": "get_weather", "arguments": '{"city": "Paris <|end|>"}'}
    assert len(calls) == 1 and calls[0]["function"] == want
    msg = out.message()
    assert msg["reasoning_content"] == reasoning and msg["content"] == content
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    # the reasoning comes before the content in the stream, as the model wrote it
    kinds = [k for d in deltas for k in ("reasoning_content", "content", "tool_calls") if k in d]
    assert kinds.index("content") > max(i for i, k in enumerate(kinds) if k == "reasoning_content")


def test_a_call_cut_by_max_tokens_is_dropped_and_the_rest_kept():
    out = ChoiceOutput(OutputPlan(harmony=True))
    cut = OUTPUT[: OUTPUT.index('"Paris') + 4]
    deltas = [e.to_openai() for e in out.feed(cut) + out.finish(truncated=True)]
    assert not any("tool_calls" in d for d in deltas) and out.message().get("tool_calls") is None
    assert out.message()["content"] == "Checking."
