"""Video inputs of Qwen2-VL and Qwen2.5-VL (models/qwen_video.py, the adapter, the engine) against
transformers on tiny random configs (fp32, CPU).

The reference gets the same input_ids and pixel_values_videos as Foveal (transformers' video processor
needs torchvision, which this CPU install lacks: where torchvision loads, the patches themselves are
compared with it below) and computes its own positions (get_rope_index over mm_token_type_ids), tower
pass and logits. The clips are short enough that a video's time axis stays within its height and width,
where transformers' rule for the text after a video and Qwen's agree (see mrope_prompt_positions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foveal.engine.llm import LLM
from foveal.models.qwen2_vl import mrope_prompt_positions
from foveal.models.qwen_video import QwenVideoConfig, frame_indices, video_patches
from foveal.request import VideoClip
from tests.tiny_vlm import build, foveal_greedy, hf_greedy, hf_greedy_ids, image

TOL = 1e-4
STEPS = 8
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def tiny(request, tmp_path_factory):
    return build(request.param, str(tmp_path_factory.mktemp(request.param)))


def _keeps_fractional_seconds() -> bool:
    """transformers 5.17 truncates Qwen2.5-VL's seconds per temporal patch to an integer in its positions
    (`int(next(second_per_grid_ts))`: 0 at 4 fps); Qwen's reference and later transformers keep the
    fraction, as Foveal does. Where the installed one truncates, the clips run at 2 fps (1 s a patch),
    where both agree."""
    import inspect

    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl

    return "int(next(second_per_grid_ts))" not in inspect.getsource(modeling_qwen2_5_vl)


FPS = 4.0 if _keeps_fractional_seconds() else 2.0


def clip(frames: int, h: int, w: int, seed: int, fps: float = FPS) -> VideoClip:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (frames, h, w, 3), generator=g, dtype=torch.uint8).numpy()
    return VideoClip(data, fps, content_hash=f"clip-{frames}-{h}-{w}-{seed}")


def engine_for(tiny, **kw) -> LLM:
    opts = dict(model=tiny.path, dtype="float32", device="cpu", num_blocks=256, block_size=4)
    opts.update({"enable_prefix_caching": False, **kw})
    return LLM(**opts)


def hf_video_greedy(tiny, llm, text: str, video: VideoClip, steps: int):
    """transformers on the same token ids and patches: prompt logits and greedy tokens."""
    p = llm.processor.render_prompt(text, videos=[video])
    (item,) = p.items
    t, h, w = item.data["video_grid_thw"][0].tolist()
    start = int(p.rope.table[0, item.offset])
    assert int(p.rope.table[0, item.end - 1]) - start < max(h, w) // 2, "a time axis past the grid"
    return hf_greedy_on(tiny.hf, p.prompt_token_ids, item.data, steps)


def hf_greedy_on(hf, prompt_ids: list[int], video: dict, steps: int):
    """transformers' prompt logits and greedy tokens for token ids holding one clip (its item's data)."""
    ids = torch.tensor([prompt_ids])
    inputs = {
        "pixel_values_videos": video["pixel_values_videos"],
        "video_grid_thw": video["video_grid_thw"],
        "mm_token_type_ids": (ids == hf.config.video_token_id).long() * 2,
    }
    if "second_per_grid_t" in video and "Qwen2_5" in type(hf.model).__name__:
        inputs["second_per_grid_ts"] = video["second_per_grid_t"].float()
    return hf_greedy_ids(hf, prompt_ids, inputs, steps)


def cases():
    # 4 frames of 56x84 px: grid t=2, 4x6 patches -> 2x3 merged cells a frame, 12 video tokens; at 4
    # fps Qwen2.5's temporal step is tokens_per_second x 0.5 s
    return [
        (f"<|user|>{VIDEO}What happens here?\n<|assistant|>", clip(4, 56, 84, 1)),
        (f"<|user|>Watch {VIDEO} and describe it.\n<|assistant|>", clip(3, 84, 56, 2)),
    ]


def test_video_prompts_match_transformers_alone_and_batched(tiny):
    llm = engine_for(tiny)
    cs = cases()
    for (text, video), (logits, toks, _) in zip(
        cs, foveal_greedy(llm, [llm.processor.render_prompt(t, videos=[v]) for t, v in cs], STEPS)
    ):
        ref_logits, ref_toks = hf_video_greedy(tiny, llm, text, video, STEPS)
        assert (logits - ref_logits).abs().max().item() < TOL
        assert toks == ref_toks
    # mixed with a text and an image request in one batch: each as alone
    im = tiny.image_text
    mixed = [
        llm.processor.render_prompt(cs[0][0], videos=[cs[0][1]]),
        llm.processor.render_prompt("<|user|>Say something.\n<|assistant|>"),
        llm.processor.render_prompt(f"<|user|>{im}What is this?\n<|assistant|>", images=[image(40, 30, 1)]),
        llm.processor.render_prompt(cs[1][0], videos=[cs[1][1]]),
    ]
    together = foveal_greedy(llm, mixed, STEPS)
    alone = [foveal_greedy(llm, [p], STEPS)[0] for p in mixed]
    for a, b in zip(together, alone):
        assert a[1] == b[1] and (a[0] - b[0]).abs().max().item() < TOL
    ref_img = hf_greedy(tiny, f"<|user|>{im}What is this?\n<|assistant|>", [image(40, 30, 1)], STEPS)
    assert together[2][1] == ref_img[1]


@pytest.mark.parametrize("budget", [5, 11])
def test_chunked_prefill_inside_a_video_span(tiny, budget):
    llm = engine_for(tiny, max_num_batched_tokens=budget)
    text, video = cases()[0]
    p = llm.processor.render_prompt(text, videos=[video])
    (it,) = p.items
    assert it.offset // budget != (it.end - 1) // budget, "the budget must split the video's span"
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    ref_logits, ref_toks = hf_video_greedy(tiny, llm, text, video, STEPS)
    assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks


def test_a_repeated_clip_hits_the_vision_cache_and_the_prefix_cache(tiny):
    cold = engine_for(tiny)
    warm = engine_for(tiny, enable_prefix_caching=True)
    text, video = cases()[0]
    ((ref_logits, ref_toks, _),) = foveal_greedy(
        cold, [cold.processor.render_prompt(text, videos=[video])], STEPS
    )
    foveal_greedy(warm, [warm.processor.render_prompt(text, videos=[video])], STEPS)
    encoded = warm.engine.runner.num_encoded
    p = warm.processor.render_prompt(text, videos=[video])
    ((logits, toks, _),) = foveal_greedy(warm, [p], STEPS)
    hit = len(p.prompt_token_ids) - logits.shape[0]
    assert hit >= len(p.prompt_token_ids) - 4 and toks == ref_toks
    assert (logits - ref_logits[hit:]).abs().max().item() < TOL
    # without the prefix cache, the same frames (a fresh array) come from the vision cache
    again = VideoClip(video.frames.copy(), video.fps, video.content_hash)
    before = cold.engine.runner.num_encoded
    foveal_greedy(cold, [cold.processor.render_prompt(text, videos=[again])], 1)
    assert cold.engine.runner.num_encoded == before
    # other frames under the same placeholder tokens: a miss in both caches past the video's start
    other = clip(4, 56, 84, 9)
    q = warm.processor.render_prompt(text, videos=[other])
    assert q.prompt_token_ids == p.prompt_token_ids
    ((logits2, _, _),) = foveal_greedy(warm, [q], 1)
    assert len(q.prompt_token_ids) - logits2.shape[0] <= q.items[0].offset
    assert warm.engine.runner.num_encoded == encoded + 1


def test_video_positions_count_time_and_resume_past_the_span():
    """The time axis of a video's cells is int(i * step) from the span's start; height and width are
    the merged grid; the text after it starts one past the span's largest position."""
    length = 3 + 2 * 2 * 3 + 2
    rope = mrope_prompt_positions(length, [(3, (2, 4, 6), 5.0)], merge=2)
    pos = rope.table
    assert pos[:, :3].tolist() == [[0, 1, 2]] * 3
    video = pos[:, 3:15]
    assert video[0].tolist() == [3] * 6 + [8] * 6
    assert video[1].tolist() == [3, 3, 3, 4, 4, 4] * 2 and video[2].tolist() == [3, 4, 5] * 4
    assert pos[:, 15:].tolist() == [[9, 10]] * 3  # 8 + 1: past the time axis, not 3 + max(h, w)
    assert rope.delta == 11 - length


def test_frame_sampling_follows_the_processor_rules():
    cfg = QwenVideoConfig.from_dict({"min_frames": 4, "max_frames": 16, "fps": 2.0})
    # 10 s at 30 fps, 2 fps wanted: 20 frames -> capped at 16, evenly spread
    idx = frame_indices(cfg, 300, 30.0)
    assert len(idx) == 16 and idx == [int(i * 300 / 16) for i in range(16)]
    assert frame_indices(cfg, 300, 30.0, fps=1.0) == [i * 30 for i in range(10)]  # 10 frames, even
    assert len(frame_indices(cfg, 300, 30.0, fps=1.0, max_frames=7)) == 6  # floored to the patch
    # num_frames rounds to the temporal patch as Python rounds (half to even), as transformers does
    assert frame_indices(cfg, 300, 30.0, num_frames=5) == [0, 75, 150, 225]
    assert frame_indices(cfg, 300, 30.0, num_frames=7) == [int(i * 300 / 8) for i in range(8)]
    assert frame_indices(cfg, 3, 30.0) == [0, 1]  # min_frames past the clip: what it has, even
    with pytest.raises(ValueError):
        frame_indices(cfg, 0, 30.0)


def test_patches_of_a_still_clip_equal_the_image_processors():
    """Two identical frames whose size needs no resize: the video patches equal the image processor's
    patches for that picture (an image is one temporal patch of a repeated frame)."""
    from tests.tiny_vlm import image_processor_class

    frame = np.asarray(image(84, 56, 4))
    ip = image_processor_class("Qwen2VLImageProcessor")(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    )
    ref = ip(images=[frame], return_tensors="pt")
    cfg = QwenVideoConfig.from_dict({"size": {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}})
    patches, grid = video_patches(cfg, torch.from_numpy(np.stack([frame, frame])))
    assert list(grid) == ref["image_grid_thw"][0].tolist()
    assert (patches - ref["pixel_values"]).abs().max().item() < 1e-5


def test_resize_in_float_passes_equals_the_uint8_kernel():
    """Frames off the CPU resize in two float passes, each rounded and clamped: within one level of torch's
    uint8 kernel to 2 levels (torchvision, and so transformers' video processors, use it); one float pass
    differs by ~20 levels on noise (bicubic overshoot clamped between the passes)."""
    from foveal.models.qwen_video import resize_two_pass, resize_uint8

    x = torch.from_numpy(clip(5, 61, 97, 3).frames).permute(0, 3, 1, 2)
    want = resize_uint8(x, 56, 112).int()
    assert (resize_two_pass(x, 56, 112).int() - want).abs().max().item() <= 2  # its fixed-point weights
    one = torch.nn.functional.interpolate(x.float(), size=(56, 112), mode="bicubic", antialias=True)
    assert (one.round().clamp(0, 255).int() - want).abs().max().item() > 5  # the difference is real


def test_patches_equal_transformers_video_processor():
    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from transformers import Qwen2VLVideoProcessor

    frames = clip(5, 61, 97, 3).frames  # resized: 61x97 is no multiple of 28
    size = {"shortest_edge": 56 * 56, "longest_edge": 112 * 112}
    vp = Qwen2VLVideoProcessor(size=size)  # the per-frame cap does not bind at this size
    ref = vp(videos=[frames], return_tensors="pt", do_sample_frames=False)
    patches, grid = video_patches(QwenVideoConfig.from_dict({"size": size}), torch.from_numpy(frames))
    assert list(grid) == ref["video_grid_thw"][0].tolist()
    assert (patches - ref["pixel_values_videos"]).abs().max().item() < 0.02  # both resize by the uint8 kernel


def test_video_composes_with_speculation_and_structured_outputs(tiny):
    """n-gram speculation on a video prompt gives plain greedy's tokens; a regex-constrained answer to
    a video prompt matches its pattern (each request alone and batched with a text request)."""
    import re

    from foveal.request import SamplingParams
    from foveal.structured import OutputConstraint

    text, video = cases()[0]
    plain = engine_for(tiny)
    spec = engine_for(
        tiny,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
        },
    )
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = (
        plain.generate([plain.processor.render_prompt(text, videos=[video])], greedy)[0].outputs[0].token_ids
    )
    got = spec.generate([spec.processor.render_prompt(text, videos=[video])], greedy)[0].outputs[0].token_ids
    assert got == want
    stats = spec.engine.speculation.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, "no draft was verified"
    pattern = r"[a-c]{3}-\d{2}"
    shaped = SamplingParams(
        temperature=1.0, seed=3, max_tokens=12, structured=OutputConstraint.regex(pattern)
    )
    outs = plain.generate(
        [plain.processor.render_prompt(text, videos=[video]), plain.processor.render_prompt("<|user|>hi\n")],
        shaped,
    )
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outs)


# -- Qwen3-VL: timestamps between the frames -----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return build("qwen3_vl", str(tmp_path_factory.mktemp("qwen3_vl")))


def test_qwen3_vl_video_matches_transformers(tiny3):
    """Each temporal patch is `<t seconds><|vision_start|>` + its cells + `<|vision_end|>` (the times as
    transformers' processor computes them), positioned frame by frame; logits and greedy tokens equal
    transformers' given the same ids and patches, alone, batched and chunked inside the span."""
    from transformers import Qwen3VLProcessor

    # 6 frames of 64x96 at 4 fps from a 12 fps source (indices 0, 3, 6, ...): 3 temporal patches
    clip3 = VideoClip(clip(6, 64, 96, 5).frames, 4.0, "q3", tuple(i / 12 for i in range(0, 18, 3)))
    text = f"<|user|>{VIDEO}What happens?\n<|assistant|>"
    for llm in (engine_for(tiny3), engine_for(tiny3, max_num_batched_tokens=7)):
        p = llm.processor.render_prompt(text, videos=[clip3])
        (it,) = p.items
        t, h, w = it.data["video_grid_thw"][0].tolist()
        times = Qwen3VLProcessor._calculate_timestamps(None, list(range(0, 18, 3)), 12.0, 2)
        shown = llm.processor.tokenizer.decode(p.prompt_token_ids[it.offset - 16 : it.end + 1])
        assert all(f"<{s:.1f} seconds>" in shown for s in times) and t == len(times) == 3
        assert it.embed_index is not None and int((it.embed_index >= 0).sum()) == t * h * w // 4
        ids = torch.tensor([p.prompt_token_ids])
        inputs = {
            "pixel_values_videos": it.data["pixel_values_videos"],
            "video_grid_thw": it.data["video_grid_thw"],
            "mm_token_type_ids": (ids == tiny3.hf.config.video_token_id).long() * 2,
        }
        want, toks = hf_greedy_ids(tiny3.hf, p.prompt_token_ids, inputs, STEPS)
        text_only = llm.processor.render_prompt("<|user|>hi\n<|assistant|>")
        (got, _) = foveal_greedy(llm, [p, text_only], STEPS)
        assert (got[0] - want).abs().max().item() < TOL and got[1] == toks


def test_a_lora_adapter_on_a_video_prompt_equals_peft(tmp_path):
    """LoRA composes with video: an adapter on Qwen2-VL's language model, a video prompt, greedy tokens
    equal to PEFT's model on the same ids and patches (and different from the base model's)."""
    from foveal import LoRARequest
    from foveal.request import SamplingParams
    from tests.lora_models import save_adapter

    tiny = build("qwen2_vl", str(tmp_path / "vlm"))
    target = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"
    text, video = cases()[0]
    base = engine_for(tiny)
    _, base_toks = hf_video_greedy(tiny, base, text, video, STEPS)
    pm = save_adapter(tmp_path / "adapter", tiny.hf.model, 8, seed=3, target_modules=target)
    llm = engine_for(tiny, enable_lora=True, max_lora_rank=8)
    prompt = llm.processor.render_prompt(text, videos=[video])
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    got = llm.generate([prompt], params, lora_request=LoRARequest("v", str(tmp_path / "adapter")))
    tiny.hf = type(tiny.hf)(pm)  # the reference: the same ids and patches through PEFT's model
    _, want = hf_video_greedy(tiny, llm, text, video, STEPS)
    assert list(got[0].outputs[0].token_ids) == want
    assert want != base_toks  # the adapter matters on this prompt


@pytest.mark.parametrize("family", ["qwen2_5", "qwen3"])
def test_a_clip_in_parts_encodes_over_steps_and_equals_transformers(tiny, tiny3, family, monkeypatch):
    """A clip longer than VIDEO_PART_EMBEDS is several items of whole temporal patches (the tower
    attends within one at a time): the same positions as the whole clip, the scheduler's encoder budget
    spreads the parts over steps, and logits and greedy tokens equal transformers' on the whole clip."""
    import foveal.models.qwen2_vl as qv

    t_ = tiny3 if family == "qwen3" else tiny
    if family == "qwen2_5" and "Qwen2_5" not in type(tiny.hf.model).__name__:
        pytest.skip("the qwen2_vl build of `tiny`: covered by its qwen2_5_vl build")
    # Qwen2.5: 4 frames (2 temporal patches): a longer time axis would outrun the grid, where our positions
    # keep the Qwen rule and transformers' do not (test_video_positions_count_time_and_resume_past_the_span)
    video = clip(4, 56, 84, 7) if family == "qwen2_5" else VideoClip(clip(8, 64, 96, 6).frames, 4.0, "q3p")
    text = f"<|user|>{VIDEO}What happens?\n<|assistant|>"
    whole = engine_for(t_).processor.render_prompt(text, videos=[video])
    (one,) = whole.items
    monkeypatch.setattr(qv, "VIDEO_PART_EMBEDS", 1)  # one temporal patch a part
    llm = engine_for(t_, max_encoder_tokens_per_step=1)
    p = llm.processor.render_prompt(text, videos=[video])
    t = int(one.data["video_grid_thw"][0, 0])
    assert t == (2 if family == "qwen2_5" else 4) and len(p.items) == t
    assert p.prompt_token_ids == whole.prompt_token_ids
    assert torch.equal(p.rope.table, whole.rope.table) and p.rope.delta == whole.rope.delta
    assert torch.equal(
        torch.cat([it.data["pixel_values_videos"] for it in p.items]), one.data["pixel_values_videos"]
    )
    encoded = []  # items a tower pass took
    model = llm.engine.model
    real = model.encode_images
    monkeypatch.setattr(model, "encode_images", lambda items: encoded.append(len(items)) or real(items))
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    assert encoded == [1] * t  # one part a step: the budget holds
    again = foveal_greedy(llm, [llm.processor.render_prompt(text, videos=[video])], STEPS)[0]
    assert encoded == [1] * t and again[1] == toks  # the same clip again: every part from the vision cache
    want, ref = hf_greedy_on(t_.hf, whole.prompt_token_ids, one.data, STEPS)
    assert (logits - want).abs().max().item() < TOL and toks == ref
