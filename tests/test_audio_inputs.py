"""Audio inputs of Qwen2-Audio (models/qwen2_audio.py) against transformers on a tiny random config
(fp32, CPU): the model's own processor (Whisper features, the placeholder expanded to the pooled
frames) feeds the reference; Foveal takes the same samples as an AudioClip. Prompt logits and greedy
tokens alone, batched with text requests, chunked inside the audio span; a repeated clip hits the
encoder cache; prefix hit == miss."""

from __future__ import annotations

import numpy as np
import pytest

from foveal.engine.llm import LLM
from foveal.request import AudioClip
from tests.tiny_audio import AUDIO, build_qwen2_audio
from tests.tiny_vlm import foveal_greedy, hf_greedy_ids

TOL = 1e-4
STEPS = 8
SR = 16000


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_qwen2_audio(str(tmp_path_factory.mktemp("qwen2_audio")))


def sound(seconds: float, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    return (0.3 * np.sin(2 * np.pi * (200 + 100 * seed) * t) + 0.05 * g.standard_normal(t.size)).astype(
        np.float32
    )


def engine_for(path, **kw) -> LLM:
    opts = {
        "dtype": "float32",
        "device": "cpu",
        "num_blocks": 512,
        "block_size": 4,
        "enable_prefix_caching": False,
    }
    return LLM(path, **{**opts, **kw})


def hf_greedy(hf, proc, text: str, samples: np.ndarray, steps: int):
    inputs = proc(text=[text], audio=[samples], sampling_rate=SR, return_tensors="pt")
    ids = inputs.pop("input_ids")
    inputs.pop("attention_mask", None)
    return hf_greedy_ids(hf, ids[0].tolist(), dict(inputs), steps)


CASES = [("<|user|>Listen: {a} What is it?\n<|assistant|>", 1.3, 1), ("<|user|>{a}\n<|assistant|>", 0.4, 2)]


def test_audio_prompts_match_transformers_alone_and_batched(tiny):
    path, hf, proc = tiny
    llm = engine_for(path)
    prompts = [
        llm.processor.render_prompt(t.format(a=AUDIO), audios=[AudioClip(sound(s, k), SR, f"s{k}")])
        for t, s, k in CASES
    ]
    text_only = llm.processor.render_prompt("<|user|>Say something.\n<|assistant|>")
    together = foveal_greedy(llm, [prompts[0], text_only, prompts[1]], STEPS)
    for (t, s, k), (logits, toks, _) in zip(CASES, [together[0], together[2]]):
        ref_logits, ref_toks = hf_greedy(hf, proc, t.format(a=AUDIO), sound(s, k), STEPS)
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max().item() < TOL
        assert toks == ref_toks
    assert together[1][1] == foveal_greedy(llm, [text_only], STEPS)[0][1]


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_inside_the_audio_span(tiny, budget):
    path, hf, proc = tiny
    llm = engine_for(path, max_num_batched_tokens=budget)
    t, s, k = CASES[0]
    p = llm.processor.render_prompt(t.format(a=AUDIO), audios=[AudioClip(sound(s, k), SR, "x")])
    (it,) = p.items
    assert it.modality == "audio" and it.offset // budget != (it.end - 1) // budget
    ((logits, toks, _),) = foveal_greedy(llm, [p], STEPS)
    ref_logits, ref_toks = hf_greedy(hf, proc, t.format(a=AUDIO), sound(s, k), STEPS)
    assert (logits - ref_logits).abs().max().item() < TOL and toks == ref_toks


def test_a_repeated_clip_hits_the_encoder_cache_and_the_prefix_cache(tiny):
    path, _, _ = tiny
    cold, warm = engine_for(path), engine_for(path, enable_prefix_caching=True)
    t, s, k = CASES[0]

    def prompt(llm, samples):
        return llm.processor.render_prompt(t.format(a=AUDIO), audios=[AudioClip(samples, SR, "same")])

    ((ref_logits, ref_toks, _),) = foveal_greedy(cold, [prompt(cold, sound(s, k))], STEPS)
    encoded = cold.engine.runner.num_encoded
    foveal_greedy(cold, [prompt(cold, sound(s, k).copy())], 1)
    assert cold.engine.runner.num_encoded == encoded, "the encoder ran for a cached clip"
    foveal_greedy(warm, [prompt(warm, sound(s, k))], STEPS)
    p = prompt(warm, sound(s, k))
    ((logits, toks, _),) = foveal_greedy(warm, [p], STEPS)
    hit = len(p.prompt_token_ids) - logits.shape[0]
    assert hit >= len(p.prompt_token_ids) - 4 and toks == ref_toks
    assert (logits - ref_logits[hit:]).abs().max().item() < TOL


def test_too_long_or_wrong_rate_is_refused(tiny):
    path, _, _ = tiny
    llm = engine_for(path)
    with pytest.raises(ValueError, match="at most 30 s"):
        llm.processor.render_prompt(AUDIO, audios=[AudioClip(np.zeros(31 * SR, np.float32), SR)])
    with pytest.raises(ValueError, match="16000 Hz"):
        llm.processor.render_prompt(AUDIO, audios=[AudioClip(np.zeros(SR, np.float32), 8000)])
    with pytest.raises(ValueError, match="placeholders"):
        llm.processor.render_prompt("no placeholder", audios=[AudioClip(np.zeros(SR, np.float32), SR)])
    with pytest.raises(ValueError, match="does not accept images"):
        llm.processor.render_prompt(
            AUDIO, images=[object()], audios=[AudioClip(np.zeros(SR, np.float32), SR)]
        )
