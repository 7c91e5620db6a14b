"""Videos through the HTTP API: a real server on a tiny random Qwen2.5-VL, the official `openai` client
sending `video_url` parts (vLLM's shape) as data: URLs of clips written here with PyAV. The served reply
equals the offline engine's on the same decoded, sampled frames; bad and over-limit videos are 400s that
name the problem, and the server keeps serving."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest

from foveal.engine.llm import LLM
from foveal.request import SamplingParams, VideoClip
from foveal.server import video
from tests.test_server import _serve
from tests.test_video_decode import encode
from tests.tiny_vlm import build, image, save_tiny_text_model


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def a_clip(n: int = 12, size=(84, 56), color=None) -> bytes:
    """n frames at 10 fps, frame i a grey of level 8 * i (mjpeg in avi)."""
    return encode("mjpeg", "avi", n, size=size, color=color)


def _png(img) -> str:
    import io

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts) -> list[dict]:
    return [
        {"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]}
    ]


def vid(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build("qwen2_5_vl", str(tmp_path_factory.mktemp("qwen2_5_vl")))


@pytest.fixture(scope="module")
def srv(tiny):
    s, th = _serve({"model": tiny.path}, {"limit_videos_per_request": 1, "max_video_duration": 5.0})
    yield s
    s.server.should_exit = True
    th.join(15)


def test_a_served_video_chat_equals_the_offline_engine(srv, tiny):
    data = a_clip()
    r = srv.client().chat.completions.create(
        model=srv.model, messages=user("What happens?", vid(data_url(data))), max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "mm_processor_kwargs": {"fps": 4}},
    )  # fmt: skip
    assert r.usage.completion_tokens == 8
    # offline: the same bytes decoded with the model's sampling at 4 fps (12 frames at 10 fps -> 4)
    llm = LLM(tiny.path, dtype="float32", enable_prefix_caching=False)
    proc = llm.processor
    v = video.decode_video(
        data, video.VideoLimits(), lambda m: proc.frame_indices(m.total_frames, m.fps, fps=4, max_frames=256)
    )
    assert len(v.indices) == 4
    clip = VideoClip(v.frames, len(v.indices) / v.metadata.total_frames * v.metadata.fps)
    want = llm.chat(
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What happens?"}, {"type": "video", "video": clip}],
            }
        ],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    )[0]
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # streamed == whole
    chunks = srv.client().chat.completions.create(
        model=srv.model, messages=user("What happens?", vid(data_url(data))), max_tokens=8, temperature=0,
        stream=True, extra_body={"ignore_eos": True, "mm_processor_kwargs": {"fps": 4}},
    )  # fmt: skip
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    )


def test_a_video_beside_an_image_and_sampling_by_frame_count(srv):
    r = srv.client().chat.completions.create(
        model=srv.model, max_tokens=4, temperature=0,
        messages=user("Compare", {"type": "image_url", "image_url": {"url": _png(image(40, 30, 1))}},
                      "with", vid(data_url(a_clip()))),
        extra_body={"mm_processor_kwargs": {"num_frames": 6}},
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")


def test_a_video_as_a_list_of_frames_equals_the_offline_clip(srv, tiny):
    """{"type": "video", "video": [image URLs], "fps": ...}: the images are the clip's frames as given
    (a frame of another size is resized to the first's); the reply equals the offline engine's on the
    same frames; too many frames and a bad frame are 400s naming them."""
    import numpy as np

    frames = [image(56, 84, k) for k in range(4)]
    body = {"type": "video", "video": [_png(f) for f in frames], "fps": 1.0}
    r = srv.client().chat.completions.create(
        model=srv.model, messages=user("What happens?", body), max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    llm = LLM(tiny.path, dtype="float32", enable_prefix_caching=False)
    clip = VideoClip(np.stack([np.asarray(f.convert("RGB")) for f in frames]), 1.0)
    want = llm.chat(
        user("What happens?", {"type": "video", "video": clip}),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    )[0]
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    odd = {**body, "video": body["video"][:3] + [_png(image(30, 20, 9))]}  # resized, not refused
    ok = srv.client().chat.completions.create(model=srv.model, messages=user(odd), max_tokens=2)
    assert ok.usage.completion_tokens == 2
    for bad, expect in (
        ({**body, "video": [_png(image(4, 4, 0))] * 300}, "300 frames; this server allows"),
        ({**body, "video": [_png(frames[0]), "data:image/png;base64,AAAA"]}, "video 1, frame 2"),
        ({**body, "fps": 0}, "fps"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().chat.completions.create(model=srv.model, messages=user(bad), max_tokens=2)
        assert expect in str(e.value)
    assert srv.engine.kv.num_used_blocks == 0


PNG = _png(image(20, 20, 1))
BOTH = {"mm_processor_kwargs": {"fps": 1, "num_frames": 4}}


@pytest.mark.parametrize(
    "what, content, extra, expect",
    [
        ("not a video", [vid(data_url(b"hello world" * 10))], {}, "not a valid video"),
        ("an image as video", [vid(PNG.replace("image/png", "video/mp4"))], {}, "not a valid video"),
        ("a truncated mp4", [vid(data_url(encode()[: len(encode()) // 2]))], {}, "video 1"),
        ("too long", [vid(data_url(a_clip(70, color=100)))], {}, "duration limit of 5 s"),
        ("two videos", [vid(data_url(a_clip())), vid(data_url(a_clip()))], {}, "allows 1"),
        ("an image data URL", [vid(PNG)], {}, "not a video"),
        ("fps and num_frames", [vid(data_url(a_clip()))], BOTH, "not both"),
        ("a private URL", [vid("http://127.0.0.1:1/x.mp4")], {}, "private"),
    ],
)
def test_bad_video_input_is_a_400(srv, what, content, extra, expect):
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": content}], max_tokens=2, extra_body=extra
        )
    assert expect in str(e.value), what
    ok = srv.client().chat.completions.create(model=srv.model, messages=user("still there?"), max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert srv.engine.kv.num_used_blocks == 0


def test_video_to_a_model_without_video_is_a_400(tmp_path):
    path = save_tiny_text_model(str(tmp_path / "text"))
    s, th = _serve({"model": path}, {})
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(
                model=s.model, messages=user("hi", vid(data_url(a_clip()))), max_tokens=2
            )
        assert "text-only" in str(e.value) and "videos" in str(e.value)
    finally:
        s.server.should_exit = True
        th.join(15)
    llava = build("llava", str(tmp_path / "llava"))
    s, th = _serve({"model": llava.path}, {})
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(
                model=s.model, messages=user("hi", vid(data_url(a_clip()))), max_tokens=2
            )
        assert "does not accept video" in str(e.value)
    finally:
        s.server.should_exit = True
        th.join(15)


def test_decoded_video_bytes_are_bounded_across_requests(tiny):
    """One video whose sampled frames would pass the whole in-flight budget is a 400 naming it; a budget
    held by other requests makes a request wait, then a 429; every request gives its bytes back."""
    # 4 frames of 84x56 RGB = 56,448 bytes decoded
    s, th = _serve({"model": tiny.path}, {"max_video_bytes_in_flight": 50_000, "image_queue_timeout": 0.2})
    try:
        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(
                model=s.model, messages=user("hi", vid(data_url(a_clip()))), max_tokens=2,
                extra_body={"mm_processor_kwargs": {"num_frames": 4}},
            )  # fmt: skip
        assert "need 56448 bytes decoded, over the limit of 50000 bytes" in str(e.value)
        budget = s.app.state.prompts.video_bytes
        assert budget.in_use == 0
        small = {"mm_processor_kwargs": {"num_frames": 2}}  # 28,224 bytes: fits
        assert budget.acquire(30_000, 1.0)  # another request holds most of it
        with pytest.raises(openai.RateLimitError):
            s.client().chat.completions.create(
                model=s.model, messages=user("hi", vid(data_url(a_clip()))), max_tokens=2, extra_body=small
            )
        budget.release(30_000)
        ok = s.client().chat.completions.create(
            model=s.model, messages=user("hi", vid(data_url(a_clip()))), max_tokens=2, extra_body=small
        )
        assert ok.usage.completion_tokens == 2 and budget.in_use == 0
    finally:
        s.server.should_exit = True
        th.join(15)


def test_hostile_and_heavy_videos_do_not_stall_a_stream(srv):
    """While one chat streams, other requests send at once three 720p clips to decode (every frame up to
    the last sampled one), a clip whose frames span 10 hours, a truncated mp4 and random bytes: the bad
    ones are 400s, the good ones answer, and the stream's tokens keep coming (decoding runs in the input
    pool, never on the model thread)."""
    import asyncio
    import random

    from tests.test_adversarial import stream_gaps
    from tests.test_video_decode import gap_clip

    heavy = encode("libx264", "mp4", 30, size=(1280, 720))  # 3 s at 10 fps: 30 frames decoded for 6 sampled
    whole = encode()
    bad = [gap_clip(), whole[: len(whole) // 2], random.Random(0).randbytes(20_000)]
    stream = {  # streamed again and again until the videos are answered (one stream may end first)
        "model": srv.model, "messages": user("Count slowly."), "max_tokens": 600, "ignore_eos": True,
        "stream": True, "temperature": 0,
    }  # fmt: skip

    def body(data: bytes) -> dict:
        return {"model": srv.model, "messages": user("What is it?", vid(data_url(data))), "max_tokens": 2}

    async def main():
        gaps: list[float] = []
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
            stop = asyncio.Event()

            async def keep_streaming():  # gaps are within a stream: none is counted across two
                while not stop.is_set():
                    await stream_gaps(c, stream, gaps)

            task = asyncio.create_task(keep_streaming())
            while len(gaps) < 3:
                assert not task.done(), "the stream ended before it began"
                await asyncio.sleep(0.01)
            start = len(gaps)
            codes = await asyncio.gather(
                *(c.post("/v1/chat/completions", json=body(d)) for d in [heavy] * 3 + bad)
            )
            end = len(gaps)
            await asyncio.sleep(0.2)  # a few tokens more: the stream still runs after the videos
            stop.set()
            await task
        return gaps, start, end, [r.status_code for r in codes]

    gaps, start, end, codes = asyncio.run(main())
    assert codes == [200, 200, 200, 400, 400, 400], codes
    assert end < len(gaps), "no token came after the video requests were done"
    assert max(gaps[start : end + 1]) < 0.5, f"a {max(gaps[start : end + 1]):.2f} s gap between tokens"
    assert srv.engine.kv.num_used_blocks == 0
