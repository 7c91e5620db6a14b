"""SmolVLM2 video (foveal/models/idefics3.py SmolVLMAdapter) against transformers on a tiny SmolVLM: the
frame sampling rule (SmolVLMVideoProcessor.sample_frames), the prompt a clip becomes
(SmolVLMProcessor.replace_video_token), and the model's logits and greedy tokens for a video request
alone, beside an image request and in a batch, chunked inside the clip's span. The frames' pixels are
ours (Lanczos as the PIL image processor resizes); transformers' video processor needs torchvision."""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest
import torch

from foveal.engine.llm import LLM
from foveal.request import VideoClip
from tests.tiny_vlm import foveal_greedy, hf_greedy_ids, image
from tests.tiny_vlm_idefics import IMAGE, build_smolvlm

STEPS = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_smolvlm(str(tmp_path_factory.mktemp("smolvlm")))


def engine_for(tiny, **kw) -> LLM:
    opts = dict(model=tiny.path, dtype="float32", device="cpu", num_blocks=256, block_size=4)
    return LLM(**{**opts, "enable_prefix_caching": False, **kw})


def clip(
    frames: int, h: int, w: int, seed: int, fps: float = 1.0, duration: float | None = None
) -> VideoClip:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (frames, h, w, 3), generator=g, dtype=torch.uint8).numpy()
    times = tuple(j / fps for j in range(frames))
    return VideoClip(data, fps, f"smol-{frames}-{h}-{w}-{seed}", times, duration)


@pytest.mark.parametrize(
    "total,rate,kw",
    [
        (300, 30.0, {}),
        (3000, 30.0, {"num_frames": 8}),
        (45, 15.0, {"fps": 2.0}),
        (7, 24.0, {}),
        (90, 30.0, {}),
    ],
)
def test_frame_indices_equal_transformers_sample_frames(tiny, total, rate, kw):
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    adapter = engine_for(tiny).processor.mm_processor.adapter
    meta = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
    ref = types.SimpleNamespace(num_frames=adapter.video_num_frames, fps=adapter.video_fps)
    want = SmolVLMVideoProcessor.sample_frames(ref, meta, **kw).tolist()
    assert adapter.frame_indices(total, rate, **kw) == want


def test_the_prompt_equals_transformers_replace_video_token(tiny):
    from transformers.video_utils import VideoMetadata

    llm = engine_for(tiny)
    c = clip(3, 40, 64, 1, fps=0.5, duration=7.9)
    media = llm.processor.mm_processor.adapter.video_inputs(c, tiny.processor)
    meta = VideoMetadata(total_num_frames=3, fps=0.5, duration=7.9, frames_indices=[0, 1, 2])
    # the video processor's output: transformers before 5.25 counts the frames in pixel_values [1, T, ...]
    inputs = {"pixel_values": media.data["pixel_values"][None], "video_metadata": [meta]}
    want = type(tiny.processor).replace_video_token(tiny.processor, inputs, 0)
    assert media.text == want and "three frames" in want and "0:00:07" in want
    assert media.num_embeds == want.count(IMAGE)  # one embedding per <image> token of the text


def _hf_video(tiny, ids: list[int], pixels: torch.Tensor, steps: int):
    """transformers on the same ids and frames: prompt logits and greedy tokens (full passes)."""
    mask = torch.ones(1, *pixels.shape[:1], *pixels.shape[-2:], dtype=torch.bool)
    return hf_greedy_ids(tiny.hf, ids, {"pixel_values": pixels[None], "pixel_attention_mask": mask}, steps)


def test_a_video_request_equals_transformers_alone_batched_and_chunked(tiny):
    llm = engine_for(tiny)
    cases = [("User: watch <video> and tell.\nAssistant:", clip(3, 40, 64, 2)),
             ("User:<video> what now?\nAssistant:", clip(2, 70, 30, 3, fps=2.0))]  # fmt: skip
    prompts = [llm.processor.render_prompt(t, videos=[v]) for t, v in cases]
    for p, (logits, toks, _) in zip(prompts, foveal_greedy(llm, prompts, STEPS)):
        (item,) = p.items
        assert item.modality == "video" and item.embed_index is not None  # text inside the span
        ref_logits, ref_toks = _hf_video(tiny, p.prompt_token_ids, item.data["pixel_values"], STEPS)
        assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks
    # beside an image request and a text one, and chunked inside the span: each as alone
    alone = [t for _, t, _ in foveal_greedy(llm, prompts, STEPS)]
    im = llm.processor.render_prompt(f"User:{IMAGE}What is it?\nAssistant:", images=[image(40, 30, 1)])
    mixed = [prompts[0], im, llm.processor.render_prompt("User: hi\nAssistant:"), prompts[1]]
    together = [t for _, t, _ in foveal_greedy(llm, mixed, STEPS)]
    assert together[0] == alone[0] and together[3] == alone[1]
    chunked = engine_for(tiny, max_num_batched_tokens=16)
    assert [t for _, t, _ in foveal_greedy(chunked, prompts, STEPS)] == alone


def test_an_image_and_a_video_in_one_prompt_keep_their_own_tokens(tiny):
    """The frames' <image> tokens belong to the clip, the picture's to the image: two items whose
    embeddings land on their own positions; logits equal transformers fed the picture's crops then the
    frames in prompt order."""
    llm = engine_for(tiny)
    p = llm.processor.render_prompt(
        f"User:{IMAGE} and <video>?\nAssistant:", images=[image(56, 56, 4)], videos=[clip(2, 48, 48, 5)]
    )
    kinds = [it.modality for it in p.items]
    assert kinds == ["image", "video"]
    img, vid = p.items
    assert img.end <= vid.offset
    pixels = torch.cat([img.data["pixel_values"], vid.data["pixel_values"]])
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    ref_logits, ref_toks = _hf_video(tiny, p.prompt_token_ids, pixels, STEPS)
    assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks


def test_a_frame_becomes_one_normalized_square_crop(tiny):
    adapter = engine_for(tiny).processor.mm_processor.adapter
    frame = np.asarray(image(70, 30, 6))
    x = adapter._frame(frame)
    assert x.shape == (3, adapter.video_side, adapter.video_side) and x.abs().max() <= 1.0 + 1e-6


def test_a_served_video_chat_through_the_openai_client(tiny):
    """A clip's bytes in a video_url part, through a real server: the answer equals the offline engine
    on the same decoded frames at the same sampling (1 fps: 12 frames at 10 fps -> 1 ... sampled by the
    family's rule), streamed equal to whole."""
    from foveal.request import SamplingParams
    from foveal.server import video
    from tests.test_server import _serve
    from tests.test_server_video import a_clip, data_url, user, vid

    s, th = _serve({"model": tiny.path}, {"limit_videos_per_request": 1})
    try:
        data = a_clip(n=30)  # 3 s at 10 fps
        ask = dict(
            model=s.model, messages=user("What happens?", vid(data_url(data))), max_tokens=6, temperature=0
        )
        r = s.client().chat.completions.create(**ask, extra_body={"ignore_eos": True})
        llm = engine_for(tiny)
        proc = llm.processor
        v = video.decode_video(data, video.VideoLimits(), lambda m: proc.frame_indices(m.total_frames, m.fps))
        meta = v.metadata
        assert list(v.indices) == [0, 14, 29]  # round(1 fps x 3 s) frames over the clip
        c = VideoClip(
            v.frames, 1.0, "x", tuple(i / meta.fps for i in v.indices), meta.total_frames / meta.fps
        )
        msg = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "What happens?"}, {"type": "video", "video": c}],
            }
        ]
        want = llm.chat(msg, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        assert r.choices[0].message.content == want.outputs[0].text
        assert r.usage.prompt_tokens == len(want.prompt_token_ids)
        chunks = s.client().chat.completions.create(**ask, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    finally:
        s.server.should_exit = True
        th.join(15)


def test_frames_equal_transformers_video_processor(tiny):
    """Our frames against SmolVLMVideoProcessor's (which needs torchvision >= 0.27 for Lanczos on
    tensors; before that it falls back to bicubic itself): within a couple of uint8 levels (PIL's and
    torchvision's Lanczos round differently)."""
    tv = pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from packaging.version import Version

    if Version(tv.__version__.split("+")[0]) < Version("0.27"):
        pytest.skip("transformers resizes with bicubic, not Lanczos, before torchvision 0.27")
    from transformers import SmolVLMVideoProcessor

    adapter = copy.copy(engine_for(tiny).processor.mm_processor.adapter)
    # at SmolVLMVideoProcessor's default sizes, a real checkpoint's scale, not the tiny's 56-px crops:
    # PIL resizes this noise's 112x48 -> 56x56 height first, torchvision width first, each rounding to
    # uint8 between its passes, which parts them by ~20 levels where one pass shrinks and the other grows
    adapter.video_longest, adapter.video_side = 4 * 364, 364
    frames = clip(3, 70, 30, 4).frames
    vp = SmolVLMVideoProcessor(
        size={"longest_edge": adapter.video_longest}, max_image_size={"longest_edge": adapter.video_side}
    )
    ref = vp(videos=[frames], return_tensors="pt", do_sample_frames=False)["pixel_values"][0]
    ours = torch.stack([adapter._frame(f) for f in frames])
    assert ref.shape == ours.shape
    assert (ref - ours).abs().max().item() < 3 * 2 / 255  # 3 levels of 255 over the [-1, 1] range


def test_frames_whose_embeddings_differ_from_image_seq_len_are_refused(tiny):
    """A checkpoint whose processor writes more or fewer <image> tokens a frame than a frame gives
    embeddings (its video max_image_size against the tower's crop): a clear error, not a prompt
    transformers would reject."""
    adapter = engine_for(tiny).processor.mm_processor.adapter
    wrong = copy.copy(tiny.processor)
    wrong.image_seq_len = tiny.processor.image_seq_len + 5
    with pytest.raises(ValueError, match="image_seq_len"):
        adapter.video_inputs(clip(2, 40, 64, 1), wrong)
    assert adapter.video_inputs(clip(2, 40, 64, 1), tiny.processor).num_embeds > 0
