"""Qwen2.5-Omni's thinker (models/qwen2_5_omni.py) against transformers'
Qwen2_5OmniThinkerForConditionalGeneration on a tiny random config (fp32, CPU): prompt logits and greedy
tokens of an audio, a video and an image request, of one prompt holding an image, a clip and two audio
clips, and of a batch mixing those with a text-only request (each as alone); chunked prefill inside the
audio span; the whole model's checkpoint (thinker, talker, token2wav) served as its thinker.

The image and the audio request: the reference takes the model's own processor output (Foveal's token
ids and tensors must equal it). Videos: transformers' video processor needs torchvision, so for the video
and the mixed request the reference takes Foveal's ids and tensors, as tests/test_video_inputs.py does;
it computes its own positions (get_rope_index), encoder passes and logits from them."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from foveal.engine.llm import LLM
from foveal.request import AudioClip
from tests.test_audio_inputs import SR, sound
from tests.test_video_inputs import clip
from tests.tiny_omni import AUDIO, IMAGE, VIDEO, build_qwen2_5_omni, save_whole_model
from tests.tiny_vlm import foveal_greedy, image

TOL = 1e-4
STEPS = 8


def cases() -> dict:
    """name -> (prompt text, images, videos, audio clips). The video: 4 frames of 56x84 px at 4 fps,
    resized to 280x392 (the Omni processor's frame size: 128..768 x 28^2 pixels), 2 temporal patches of
    10x14 merged cells, 12.5 positions apart on the time axis (25 a second)."""
    return {
        "text": ("<|user|>Say something.\n<|assistant|>", [], [], []),
        "audio": (
            f"<|user|>Listen: {AUDIO} What is it?\n<|assistant|>",
            [],
            [],
            [AudioClip(sound(1.3, 1), SR, "a1")],
        ),
        "video": (f"<|user|>{VIDEO}What happens here?\n<|assistant|>", [], [clip(4, 56, 84, 1, fps=4.0)], []),
        "image": (f"<|user|>{IMAGE}What is this?\n<|assistant|>", [image(40, 30, 1)], [], []),
        "mixed": (
            f"<|user|>{IMAGE} then {VIDEO} with {AUDIO} and {AUDIO}?\n<|assistant|>",
            [image(84, 56, 2)],
            [clip(3, 84, 56, 2, fps=4.0)],
            [AudioClip(sound(0.4, 2), SR, "a2"), AudioClip(sound(0.9, 3), SR, "a3")],
        ),
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_qwen2_5_omni(str(tmp_path_factory.mktemp("qwen2_5_omni")))


def engine_for(path: str, **kw) -> LLM:
    """Without the vision cache: every run encodes its own media (alone runs alone, a batch together)."""
    opts = dict(dtype="float32", device="cpu", num_blocks=512, block_size=4, enable_prefix_caching=False)
    opts["vision_cache_memory"] = 0
    return LLM(path, **{**opts, **kw})


@pytest.fixture(scope="module")
def llm(tiny):
    return engine_for(tiny.path)


def render(llm, name: str):
    text, images, videos, audios = cases()[name]
    return llm.processor.render_prompt(text, images=images, videos=videos, audios=audios)


def hf_inputs(prompt) -> dict:
    """transformers' media inputs for a Foveal prompt's items, in prompt order."""
    data = {m: [it.data for it in prompt.items if it.modality == m] for m in ("image", "video", "audio")}
    out = {}
    if data["image"]:
        out["pixel_values"] = torch.cat([d["pixel_values"] for d in data["image"]])
        out["image_grid_thw"] = torch.cat([d["image_grid_thw"] for d in data["image"]])
    if data["video"]:
        out["pixel_values_videos"] = torch.cat([d["pixel_values_videos"] for d in data["video"]])
        out["video_grid_thw"] = torch.cat([d["video_grid_thw"] for d in data["video"]])
        out["video_second_per_grid"] = torch.cat([d["second_per_grid_t"] for d in data["video"]]).float()
    if data["audio"]:  # the clips' real frames, padded to the longest, with the mask of the real ones
        feats = [d["input_features"][0].T for d in data["audio"]]
        out["input_features"] = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True).transpose(1, 2)
        lens = torch.tensor([f.shape[0] for f in feats])
        out["feature_attention_mask"] = (torch.arange(int(lens.max()))[None, :] < lens[:, None]).long()
    return out


def hf_greedy(hf, prompt_ids: list[int], inputs: dict, steps: int):
    """transformers' prompt logits and `steps` greedy tokens: the prompt in one pass (positions from its
    get_rope_index, which reads the attention mask), then a token a pass on its KV cache (positions past
    the prompt shifted by the prompt's rope delta: transformers' own decode rule)."""
    from transformers import DynamicCache

    # transformers 5.25 renamed past_key_values to cache
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    cache = {name: DynamicCache()}
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        first = hf(
            input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, **cache, **inputs
        ).logits[0]
        tokens = [int(first[-1].argmax())]
        for _ in range(steps - 1):
            logits = hf(input_ids=torch.tensor([tokens[-1:]]), use_cache=True, **cache).logits[0]
            tokens.append(int(logits[-1].argmax()))
    return first, tokens


@pytest.fixture(scope="module")
def refs(tiny, llm) -> dict:
    """name -> (Foveal's prompt, transformers' prompt logits, its greedy tokens)."""
    out = {}
    for name, (text, images, _, audios) in cases().items():
        p = render(llm, name)
        ids, inputs = p.prompt_token_ids, hf_inputs(p)
        if name in ("audio", "image"):  # the processor's own output: Foveal's must equal it
            kw = {"images": images} if images else {"audio": [a.samples for a in audios], "sampling_rate": SR}
            proc = dict(tiny.processor(text=[text], return_tensors="pt", **kw))
            assert proc.pop("input_ids")[0].tolist() == ids
            proc.pop("attention_mask")
            if "pixel_values" in proc:
                assert torch.equal(proc["pixel_values"], inputs["pixel_values"])
            else:
                n = int(proc["feature_attention_mask"].sum())
                assert torch.equal(proc["input_features"][..., :n], inputs["input_features"])
            inputs = proc
        out[name] = (p, *hf_greedy(tiny.hf, ids, inputs, STEPS))
    return out


def close(got, want) -> bool:
    return got.shape == want.shape and (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["audio", "video", "image", "mixed"])
def test_a_request_alone_matches_transformers(llm, refs, name):
    p, want, want_toks = refs[name]
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    assert close(logits, want) and toks == want_toks


def test_positions_equal_transformers_get_rope_index(tiny, refs):
    """Image and video cells on their grids (the video's time axis in seconds), audio tokens as text, the
    text after each span one past its largest position."""
    p = refs["mixed"][0]
    inputs = hf_inputs(p)
    ids = torch.tensor([p.prompt_token_ids])
    pos, delta = tiny.hf.get_rope_index(  # the thinker's own (5.17 has none on .model)
        ids, inputs["image_grid_thw"], inputs["video_grid_thw"], torch.ones_like(ids),
        audio_seqlens=inputs["feature_attention_mask"].sum(-1),
        second_per_grids=inputs["video_second_per_grid"],
    )  # fmt: skip
    assert torch.equal(p.rope.table, pos[:, 0]) and p.rope.delta == int(delta)
    (video,) = [it for it in p.items if it.modality == "video"]
    assert video.data["video_grid_thw"].tolist() == [[2, 28, 20]]  # 84x56 px frames, resized to 392x280
    assert p.rope.table[0, video.end - 1] - p.rope.table[0, video.offset] == 12  # int(12.5)
    assert refs["audio"][0].rope is None  # audio without image or video: plain 1-D positions


def test_a_mixed_batch_equals_each_alone_and_transformers(llm, refs, monkeypatch):
    """Text-only, image, video, audio and mixed requests in one batch (their three audio clips in one
    encoder pass): each as alone, and as transformers."""
    names = ["text", "image", "video", "audio", "mixed"]
    model, passes = llm.engine.model, []
    real = model.encode_audio
    monkeypatch.setattr(model, "encode_audio", lambda items: passes.append(len(items)) or real(items))
    together = foveal_greedy(llm, [refs[n][0] for n in names], STEPS)
    assert passes == [3]
    for name, (logits, toks, _) in zip(names, together):
        ((alone, alone_toks, _),) = foveal_greedy(llm, [refs[name][0]], STEPS)
        _, want, want_toks = refs[name]
        assert close(logits, alone) and toks == alone_toks, name
        assert close(logits, want) and toks == want_toks, name


def test_chunked_prefill_inside_the_audio_spans(tiny, refs):
    llm = engine_for(tiny.path, max_num_batched_tokens=7)
    for name in ("audio", "mixed"):
        p, want, want_toks = refs[name]
        assert any(it.modality == "audio" and it.offset // 7 != (it.end - 1) // 7 for it in p.items)
        ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
        assert close(logits, want) and toks == want_toks, name


def test_the_whole_models_checkpoint_serves_its_thinker(tiny, refs, tmp_path):
    """Qwen2_5OmniForConditionalGeneration's layout (thinker tensors under `thinker.`, the decoder as
    `model.`): the thinker loads from it, the talker's and token2wav's tensors are skipped."""
    save_whole_model(tiny, str(tmp_path))
    llm = engine_for(str(tmp_path))
    p, want, want_toks = refs["mixed"]
    assert render(llm, "mixed").prompt_token_ids == p.prompt_token_ids
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    assert close(logits, want) and toks == want_toks


def test_an_audio_clip_past_the_window_is_refused(llm):
    with pytest.raises(ValueError, match="at most 5 s"):
        llm.processor.render_prompt(AUDIO, audios=[AudioClip(np.zeros(6 * SR, np.float32), SR)])
