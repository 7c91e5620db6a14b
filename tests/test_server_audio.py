"""Audio through the HTTP API on a tiny random Qwen2-Audio: `input_audio` (OpenAI's part) and `audio_url`
(vLLM's) in a chat, and `POST /v1/audio/transcriptions` through the official `openai` client, each equal
to the offline engine on the same decoded samples; bad, over-limit and misplaced audio are 4xx that
name the problem, and the server keeps serving."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from foveal.engine.llm import LLM
from foveal.request import AudioClip, SamplingParams
from foveal.server import audio
from foveal.server.protocols.transcriptions import instruction
from tests.test_audio_decode import encode, tone
from tests.test_server import _serve
from tests.tiny_audio import build_qwen2_audio
from tests.tiny_vlm import build

SR = 16000


def wav(seconds: float = 1.2, freq: float = 330.0) -> bytes:
    return encode("pcm_s16le", "wav", [tone(freq, seconds, 22050)], 22050)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def user(*parts) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}
    ]


def input_audio(data: bytes, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": fmt}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_qwen2_audio(str(tmp_path_factory.mktemp("qwen2_audio")))


MAX_TOKENS = 12  # the server's default (and cap): a transcription asks for no length


@pytest.fixture(scope="module")
def srv(tiny):
    s, th = _serve(
        {"model": tiny[0]},
        {"limit_audios_per_request": 1, "max_audio_duration": 5.0, "max_tokens": MAX_TOKENS},
    )
    yield s
    s.server.should_exit = True
    th.join(15)


@pytest.fixture(scope="module")
def offline(tiny):
    return LLM(tiny[0], dtype="float32", enable_prefix_caching=False)


def offline_reply(llm, data: bytes, text: str, n: int, ignore_eos: bool = True) -> str:
    samples = audio.decode_audio(data, audio.AudioLimits(), SR)
    parts = [{"type": "audio", "audio": AudioClip(samples, SR)}, {"type": "text", "text": text}]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos)
    return llm.chat([{"role": "user", "content": parts}], params)[0].outputs[0].text


def test_an_audio_chat_equals_the_offline_engine(srv, offline):
    data = wav()
    want = offline_reply(offline, data, "What is it?", 8)
    url = "data:audio/wav;base64," + b64(data)
    for part in (input_audio(data), {"type": "audio_url", "audio_url": {"url": url}}):
        r = srv.client().chat.completions.create(
            model=srv.model, messages=user(part, "What is it?"), max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.choices[0].message.content == want and r.usage.completion_tokens == 8


def test_transcriptions_through_the_official_client(srv, offline):
    """A transcription is the chat turn [the clip, the instruction] at the server's default length: the
    same text as that chat through the chat endpoint (the same detokenizer), the same prompt as the
    offline engine's."""
    data = wav(2.0, 440.0)
    c = srv.client()
    got = c.audio.transcriptions.create(model=srv.model, file=("clip.wav", data), language="en", prompt="Ada")
    chat = c.chat.completions.create(
        model=srv.model, messages=user(input_audio(data), instruction("en", "Ada")), temperature=0
    )
    assert got.text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens == MAX_TOKENS
    samples = audio.decode_audio(data, audio.AudioLimits(), SR)
    turn = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": instruction("en", "Ada")}]}
    ]
    ids = offline.processor.render_chat(turn, audios=[AudioClip(samples, SR)]).prompt_token_ids
    assert chat.usage.prompt_tokens == len(ids)
    text = c.audio.transcriptions.create(
        model=srv.model, file=("clip.wav", data), language="en", prompt="Ada", response_format="text"
    )
    assert text == got.text
    events = list(
        c.audio.transcriptions.create(
            model=srv.model, file=("clip.wav", data), language="en", prompt="Ada", stream=True
        )
    )  # the SDK's own event types
    assert [type(e).__name__ for e in events[-1:]] == ["TranscriptionTextDoneEvent"]
    deltas = [e for e in events[:-1] if type(e).__name__ == "TranscriptionTextDeltaEvent"]
    assert len(deltas) == len(events) - 1 and "".join(e.delta for e in deltas) == got.text == events[-1].text
    assert events[-1].usage.output_tokens == MAX_TOKENS
    verbose = c.audio.transcriptions.create(
        model=srv.model, file=("clip.wav", data), response_format="verbose_json", language="en"
    )
    assert verbose.duration == pytest.approx(2.0, abs=0.01) and verbose.language == "en"
    assert verbose.segments[0].end == verbose.duration and verbose.segments[0].text == verbose.text
    assert srv.engine.kv.num_used_blocks == 0


def _form(srv, files=None, **fields):
    return httpx.post(srv.url + "/v1/audio/transcriptions", files=files, data=fields, timeout=30)


@pytest.mark.parametrize(
    "what, files, fields, status, expect",
    [
        ("no file", {"language": (None, "en")}, {}, 400, "file is required"),
        ("not audio", {"file": ("a.wav", b"hello" * 100)}, {}, 400, "not valid audio"),
        ("too long", {"file": ("a.wav", None)}, {}, 400, "duration limit of 5 s"),
        ("bad format", {"file": ("a.wav", b"x")}, {"response_format": "srt"}, 400, "response_format"),
        ("bad temperature", {"file": ("a.wav", b"x")}, {"temperature": "hot"}, 400, "temperature"),
        ("unknown model", {"file": ("a.wav", b"x")}, {"model": "nope"}, 404, "does not exist"),
    ],
)
def test_bad_transcription_requests(srv, what, files, fields, status, expect):
    if "file" in files and files["file"][1] is None:
        files = {"file": ("a.wav", wav(6.0))}
    r = _form(srv, files, **fields)
    assert r.status_code == status and expect in r.json()["error"]["message"], (what, r.text)
    r = httpx.post(srv.url + "/v1/audio/transcriptions", json={"file": "x"})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["error"]["message"]


def test_bad_audio_in_a_chat_is_a_400_and_the_server_keeps_serving(srv):
    for content, expect in [
        ([input_audio(b"not audio at all" * 20)], "not valid audio"),
        ([input_audio(wav(6.0))], "duration limit of 5 s"),
        ([input_audio(wav()), input_audio(wav())], "allows 1"),
        ([{"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:1/a.wav"}}], "private"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().chat.completions.create(
                model=srv.model, messages=[{"role": "user", "content": content}], max_tokens=2
            )
        assert expect in str(e.value)
    ok = srv.client().chat.completions.create(model=srv.model, messages=user("still there?"), max_tokens=2)
    assert ok.usage.completion_tokens == 2 and srv.engine.kv.num_used_blocks == 0


def test_audio_to_a_model_that_does_not_hear_is_a_400(tmp_path):
    llava = build("llava", str(tmp_path / "llava"))
    s, th = _serve({"model": llava.path}, {})
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(
                model=s.model, messages=user("hi", input_audio(wav())), max_tokens=2
            )
        assert "does not accept audio" in str(e.value)
        r = _form(s, {"file": ("a.wav", wav())})
        assert r.status_code == 400 and "does not accept audio" in r.json()["error"]["message"]
    finally:
        s.server.should_exit = True
        th.join(15)
