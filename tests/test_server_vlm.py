"""Images through the HTTP API: a real server on a tiny random LLaVA (byte-level tokenizer), the official
`openai` client sending base64 images, streamed == non-streamed, the vision cache in /v1/metrics and
Prometheus, and a table of bad image inputs (each a 400 naming the problem; the server keeps serving)."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest

from tests.test_server import _serve
from tests.tiny_vlm import build, image, save_tiny_text_model


def data_url(img, fmt="PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def user(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": "user", "content": content}]


def img_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    tiny = build("llava", str(tmp_path_factory.mktemp("llava")))
    s, th = _serve({"model": tiny.path}, {"limit_images_per_request": 2, "max_image_pixels": 100 * 100})
    yield s
    s.server.should_exit = True
    th.join(15)


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    """A tiny text-only Llama folder (no processor files)."""
    path = save_tiny_text_model(str(tmp_path_factory.mktemp("llama")))
    s, th = _serve({"model": path}, {})
    yield s
    s.server.should_exit = True
    th.join(15)


def test_streamed_image_chat_equals_non_streamed(vlm):
    c = vlm.client()
    msgs = user("What is this?", img_part(data_url(image(40, 30, 1))))
    full = c.chat.completions.create(model=vlm.model, messages=msgs, max_tokens=12, temperature=0)
    chunks = list(
        c.chat.completions.create(
            model=vlm.model,
            messages=msgs,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == full.choices[0].message.content
    assert full.usage.completion_tokens == 12
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens
    # 16 image placeholders (a 4x4 patch grid) are part of the prompt
    assert full.usage.prompt_tokens > 16
    assert vlm.engine.kv.num_used_blocks == 0


def test_repeated_image_hits_the_vision_cache_and_is_reported(vlm):
    c = vlm.client()
    # different text before the image: the prefix cache cannot cover it, the vision cache must
    url = data_url(image(32, 32, 5))
    for lead in ("Describe it.", "Now tell me about it."):
        out = c.chat.completions.create(
            model=vlm.model, messages=user(lead, img_part(url)), max_tokens=6, temperature=0
        )
        assert out.usage.completion_tokens == 6
    m = httpx.get(vlm.url + "/v1/metrics").json()
    vision = m["summary"]["vision_cache"]
    assert vision["hits"] >= 1 and vision["misses"] >= 1
    assert m["latest"]["images"] == 1 and m["summary"]["images"] >= 2
    prom = httpx.get(vlm.url + "/metrics").text
    assert "foveal_vision_cache_hits_total" in prom and "foveal_images_total" in prom


def _truncated_png() -> str:
    buf = io.BytesIO()
    image(40, 40, 2).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()[:60]).decode()


BAD = [
    # (what, message parts, expected substring of the error message)
    ("corrupt image", lambda: user("hi", img_part(_truncated_png())), "image 1"),
    (
        "not an image",
        lambda: user("hi", img_part("data:image/png;base64," + base64.b64encode(b"hello world").decode())),
        "image",
    ),
    ("over the pixel cap", lambda: user("hi", img_part(data_url(image(120, 120, 3)))), "pixel"),
    ("unresolvable host", lambda: user("hi", img_part("http://no-such-host.invalid/x.png")), "fetch"),
    ("private address", lambda: user("hi", img_part("http://127.0.0.1:9/x.png")), "private"),
    ("unsupported scheme", lambda: user("hi", img_part("ftp://example.com/x.png")), "image 1"),
    ("local file without the flag", lambda: user("hi", img_part("/etc/hostname")), "local"),
    (
        "too many images",
        lambda: user(*[img_part(data_url(image(20, 20, i))) for i in range(3)]),
        "allows 2",
    ),
    (
        "image in an assistant message",
        lambda: [{"role": "assistant", "content": [img_part(data_url(image(20, 20, 1)))]}],
        "user messages",
    ),
    ("image_url not an object", lambda: user({"type": "image_url", "image_url": "x"}), "image_url"),
    ("empty url", lambda: user({"type": "image_url", "image_url": {"url": ""}}), "url"),
]


@pytest.mark.parametrize("what,make,expect", BAD, ids=[b[0] for b in BAD])
def test_bad_image_input_is_a_400(vlm, what, make, expect):
    r = httpx.post(
        vlm.url + "/v1/chat/completions",
        json={"model": vlm.model, "messages": make(), "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 400, (what, r.text)
    msg = r.json()["error"]["message"]
    assert expect.lower() in msg.lower(), (what, msg)


def test_server_keeps_serving_after_bad_images(vlm):
    c = vlm.client()
    out = c.chat.completions.create(
        model=vlm.model, messages=user("ok?", img_part(data_url(image(28, 28, 4)))), max_tokens=3
    )
    assert out.usage.completion_tokens == 3
    assert vlm.engine.kv.num_used_blocks == 0
    assert httpx.get(vlm.url + "/health").json()["status"] == "ready"


def test_image_to_a_text_only_model_is_a_400(text_only):
    c = text_only.client()
    with pytest.raises(openai.BadRequestError, match="text-only"):
        c.chat.completions.create(
            model=text_only.model, messages=user("hi", img_part(data_url(image(20, 20, 1)))), max_tokens=2
        )
    out = c.chat.completions.create(model=text_only.model, messages=user("hi"), max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_an_anthropic_image_block_equals_the_openai_image_part(vlm):
    """The same image as an Anthropic base64 block and as an OpenAI image_url part: the same prompt and
    the same greedy reply (both routes render one chat input)."""
    anthropic = pytest.importorskip("anthropic")
    url = data_url(image(40, 30, 2))
    oai = vlm.client().chat.completions.create(
        model=vlm.model, messages=user("What is this?", img_part(url)), max_tokens=8, temperature=0
    )
    media_type, data = url[len("data:") :].split(";base64,")
    block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    c = anthropic.Anthropic(base_url=vlm.url, api_key="none", max_retries=0)
    msg = c.messages.create(
        model=vlm.model, max_tokens=8, extra_body={"temperature": 0.0},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}],
    )  # fmt: skip
    assert msg.usage.input_tokens == oai.usage.prompt_tokens
    assert msg.content[0].text == oai.choices[0].message.content
