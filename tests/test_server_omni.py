"""Qwen2.5-Omni's thinker through the HTTP API (a tiny random one, tests/tiny_omni.py): the official
`openai` client sends an image, a clip and a sound in one chat turn (data: URLs and `input_audio`), and
asks for a transcription; the served replies equal the offline engine's on the same decoded media."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from foveal.engine.llm import LLM
from foveal.request import AudioClip, SamplingParams, VideoClip
from foveal.server import audio, video
from foveal.server.protocols.transcriptions import instruction
from tests.test_server import _serve
from tests.test_server_audio import input_audio, wav
from tests.test_server_video import _png, a_clip, data_url, user, vid
from tests.tiny_omni import build_qwen2_5_omni

SR = 16000
FPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_qwen2_5_omni(str(tmp_path_factory.mktemp("omni")))


@pytest.fixture(scope="module")
def srv(tiny):
    s, th = _serve({"model": tiny.path}, {"max_tokens": 8})
    yield s
    s.server.should_exit = True
    th.join(15)


def test_image_clip_and_sound_in_one_turn_equal_the_offline_engine(srv, tiny):
    g = torch.Generator().manual_seed(3)
    img = Image.fromarray(torch.randint(0, 256, (56, 84, 3), generator=g, dtype=torch.uint8).numpy())
    clip, sound = a_clip(), wav(1.3)
    parts = [{"type": "image_url", "image_url": {"url": _png(img)}}, vid(data_url(clip)), input_audio(sound)]
    r = srv.client().chat.completions.create(
        model=srv.model, messages=user("Describe all three.", *parts), max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "mm_processor_kwargs": {"fps": FPS}},
    )  # fmt: skip
    llm = LLM(tiny.path, dtype="float32", enable_prefix_caching=False)
    proc = llm.processor
    v = video.decode_video(
        clip,
        video.VideoLimits(),
        lambda m: proc.frame_indices(m.total_frames, m.fps, fps=FPS, max_frames=256),
    )
    frames = VideoClip(v.frames, len(v.indices) / v.metadata.total_frames * v.metadata.fps)
    samples = audio.decode_audio(sound, audio.AudioLimits(), SR)
    content = [
        {"type": "text", "text": "Describe all three."},
        {"type": "image", "image": img},  # a PNG: the server decodes the same pixels
        {"type": "video", "video": frames},
        {"type": "audio", "audio": AudioClip(samples, SR)},
    ]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.chat([{"role": "user", "content": content}], params)[0]
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.choices[0].message.content == want.outputs[0].text and r.usage.completion_tokens == 8


def test_a_transcription_through_the_official_client(srv):
    """Omni hears: a transcription is the chat turn [the clip, the instruction] at the server's default
    length, the same text and token counts as that chat through the chat endpoint."""
    data = wav(1.0)
    c = srv.client()
    got = c.audio.transcriptions.create(model=srv.model, file=("clip.wav", data), language="en")
    chat = c.chat.completions.create(
        model=srv.model, messages=user(input_audio(data), instruction("en", None)), temperature=0
    )
    assert got.text == chat.choices[0].message.content
    assert got.usage.input_tokens == chat.usage.prompt_tokens
    assert got.usage.output_tokens == chat.usage.completion_tokens == 8
