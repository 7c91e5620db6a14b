"""LLaVA-OneVision (foveal/models/llava_onevision.py) beyond the shared image parity tests
(tests/test_vlm_parity.py runs those on this family too): an image small enough for one tile (no
shrink), video against transformers on a tiny checkpoint (the clip's logits and greedy tokens alone,
beside image and text requests, chunked inside the clip's span, an image and a clip in one prompt),
the frame sampling rule against transformers' video processor's sampler, and the frames' pixels against
transformers' video processor where torchvision is installed (it needs it; ours does not)."""

from __future__ import annotations

import types

import pytest
import torch

from foveal.engine.llm import LLM
from foveal.request import VideoClip
from tests.tiny_vlm import foveal_greedy, hf_greedy, hf_greedy_ids, image
from tests.tiny_vlm_onevision import IMAGE, TILE, VIDEO, build_onevision

STEPS = 6
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from foveal.loader.processors import load_hf_processor

    t = build_onevision(str(tmp_path_factory.mktemp("onevision")))
    t.processor = load_hf_processor(t.path)
    return t


def engine_for(tiny, **kw) -> LLM:
    opts = dict(model=tiny.path, dtype="float32", device="cpu", num_blocks=256, block_size=4)
    return LLM(**{**opts, "enable_prefix_caching": False, **kw})


def clip(frames: int, h: int, w: int, seed: int, fps: float = 2.0) -> VideoClip:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (frames, h, w, 3), generator=g, dtype=torch.uint8).numpy()
    return VideoClip(data, fps, f"ov-{frames}-{h}-{w}-{seed}", tuple(j / fps for j in range(frames)))


def test_a_one_tile_image_is_not_shrunk(tiny):
    llm = engine_for(tiny)
    text = f"<|user|>{IMAGE}Describe.\n<|assistant|>"
    p = llm.processor.render_prompt(text, images=[image(28, 28, 9)])
    (item,) = p.items
    assert item.length == 16 + 4 * 5  # the base tile, then 4 rows of 4 features and a newline each
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    ref_logits, ref_toks, _ = hf_greedy(tiny, text, [image(28, 28, 9)], STEPS)
    assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks


def _hf_video(tiny, ids: list[int], pixels: torch.Tensor, steps: int, **extra):
    return hf_greedy_ids(tiny.hf, ids, {"pixel_values_videos": pixels[None], **extra}, steps)


def test_a_video_request_equals_transformers_alone_batched_and_chunked(tiny):
    llm = engine_for(tiny)
    cases = [(f"<|user|>watch {VIDEO} and tell.\n<|assistant|>", clip(3, 40, 64, 2)),
             (f"<|user|>{VIDEO} what now?\n<|assistant|>", clip(2, 70, 30, 3))]  # fmt: skip
    prompts = [llm.processor.render_prompt(t, videos=[v]) for t, v in cases]
    for p, (logits, toks, _) in zip(prompts, foveal_greedy(llm, prompts, STEPS)):
        (item,) = p.items
        frames = item.data["pixel_values_videos"].shape[0]
        assert item.modality == "video" and item.length == frames * 2 * 2 + 1  # pooled 4x4 -> 2x2, newline
        ref_logits, ref_toks = _hf_video(tiny, p.prompt_token_ids, item.data["pixel_values_videos"], STEPS)
        assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks
    alone = [t for _, t, _ in foveal_greedy(llm, prompts, STEPS)]
    im = llm.processor.render_prompt(f"<|user|>{IMAGE}What is it?\n<|assistant|>", images=[image(40, 30, 1)])
    mixed = [prompts[0], im, llm.processor.render_prompt("<|user|>hi\n<|assistant|>"), prompts[1]]
    together = [t for _, t, _ in foveal_greedy(llm, mixed, STEPS)]
    assert together[0] == alone[0] and together[3] == alone[1]
    chunked = engine_for(tiny, max_num_batched_tokens=7)
    assert [t for _, t, _ in foveal_greedy(chunked, prompts, STEPS)] == alone


def test_an_image_and_a_video_in_one_prompt(tiny):
    llm = engine_for(tiny)
    p = llm.processor.render_prompt(
        f"<|user|>{IMAGE} and {VIDEO}?\n<|assistant|>", images=[image(56, 56, 4)], videos=[clip(2, 48, 48, 5)]
    )
    img, vid = p.items
    assert (img.modality, vid.modality) == ("image", "video") and img.end <= vid.offset
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    inputs = tiny.processor.image_processor([image(56, 56, 4)], return_tensors="pt")
    extra = {k: inputs[k] for k in ("pixel_values", "image_sizes", "batch_num_images") if k in inputs}
    ref_logits, ref_toks = _hf_video(
        tiny, p.prompt_token_ids, vid.data["pixel_values_videos"], STEPS, **extra
    )
    assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks


@pytest.mark.parametrize(
    "total,rate,kw",
    [
        (300, 30.0, {}),
        (300, 30.0, {"num_frames": 8}),
        (45, 15.0, {"fps": 2.0}),
        (7, 24.0, {}),
        (90, 30.0, {"fps": 1}),
    ],
)
def test_frame_indices_equal_transformers_default_sampler(tiny, total, rate, kw):
    """Against the sampler transformers' OneVision video processor runs (do_sample_frames, as
    apply_chat_template's num_frames/fps turn on): BaseVideoProcessor.sample_frames, here with no
    defaults of its own. From 5.18 it is video_utils.default_sample_indices_fn (i*total//n); 5.17's
    is its own torch.arange(0, total, total/n).int(), the same frames, while that version's
    default_sample_indices_fn (np.arange(..., dtype=int): i*int(total/n)) is a different rule that
    no video processor calls."""
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    adapter = engine_for(tiny).processor.mm_processor.adapter
    meta = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
    n = kw.get("num_frames", None if "fps" in kw else min(adapter.video_frames, total))
    ref = types.SimpleNamespace(num_frames=None, fps=None)  # the processor's defaults: the arguments'
    want = LlavaOnevisionVideoProcessor.sample_frames(ref, meta, num_frames=n, fps=kw.get("fps")).tolist()
    assert adapter.frame_indices(total, rate, **kw) == want


def test_frame_pixels_equal_transformers_video_processor(tiny):
    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from transformers import LlavaOnevisionVideoProcessor

    c = clip(3, 40, 64, 7)
    ours = engine_for(tiny).processor.mm_processor.adapter.video_inputs(c, tiny.processor)
    vp = LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE})
    want = vp(videos=[torch.from_numpy(c.frames)], return_tensors="pt")["pixel_values_videos"][0]
    torch.testing.assert_close(ours.data["pixel_values_videos"], want, atol=1e-5, rtol=0)


def test_the_default_feature_strategy_is_refused(tiny):
    from foveal.models.llava_onevision import LlavaOnevisionAdapter

    cfg = type(tiny.hf.config).from_dict(
        {**tiny.hf.config.to_dict(), "vision_feature_select_strategy": "default"}
    )
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'default' is not supported"):
        LlavaOnevisionAdapter(cfg)
