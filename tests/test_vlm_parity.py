"""Vision-language models vs transformers on tiny random configs (fp32, CPU): prompt logits at every
position within 1e-4 and 16 identical greedy tokens, for prompts with 0, 1 and 2 images of different
sizes; alone, batched with other image and text requests, and with chunked prefill whose boundaries
fall inside image placeholder runs. Also the vision cache: a repeated image skips the encoder."""

from __future__ import annotations

import pytest
import torch

from foveal.engine.llm import LLM
from tests.tiny_vlm import all_builders, build, foveal_greedy, hf_greedy, image

TOL = 1e-4
STEPS = 16


@pytest.fixture(scope="module", params=sorted(all_builders()))
def tiny(request, tmp_path_factory):
    return build(request.param, str(tmp_path_factory.mktemp(request.param)))


def engine_for(tiny, **kw) -> LLM:
    # the prefix cache off: these tests compare every prompt position (test_prefix_cache_* turn it on)
    opts = dict(
        model=tiny.path,
        dtype="float32",
        device="cpu",
        num_blocks=256,
        block_size=4,
        enable_prefix_caching=False,
    )
    opts.update(kw)
    return LLM(**opts)


def cases(tiny):
    """(prompt text, images): 0, 1 and 2 images of different sizes."""
    im = tiny.image_text
    return [
        ("<|user|>Say something about nothing.\n<|assistant|>", []),
        (f"<|user|>{im}What is in this picture?\n<|assistant|>", [image(40, 30, 1)]),
        (f"<|user|>Compare {im} with {im} please.\n<|assistant|>", [image(56, 56, 2), image(28, 70, 3)]),
    ]


def check(tiny, case_list, results):
    for (text, imgs), (logits, toks, steps) in zip(case_list, results):
        ref_logits, ref_toks, ref_steps = hf_greedy(tiny, text, imgs, STEPS)
        assert logits.shape == ref_logits.shape
        err = (logits - ref_logits).abs().max().item()
        assert err < TOL, f"prompt logits differ by {err} ({len(imgs)} images)"
        assert toks == ref_toks, f"greedy tokens differ ({len(imgs)} images)"
        for a, b in zip(steps, ref_steps):
            assert (a - b).abs().max().item() < TOL


def prompts(llm, case_list):
    return [llm.processor.render_prompt(t, images=i) for t, i in case_list]


def test_each_prompt_alone_matches_transformers(tiny):
    llm = engine_for(tiny)
    cs = cases(tiny)
    for c in cs:
        check(tiny, [c], foveal_greedy(llm, prompts(llm, [c]), STEPS))


def test_batched_image_and_text_requests_match(tiny):
    llm = engine_for(tiny)
    cs = cases(tiny) + cases(tiny)[::-1]
    check(tiny, cs, foveal_greedy(llm, prompts(llm, cs), STEPS))


@pytest.mark.parametrize("budget", [5, 13])
def test_chunked_prefill_inside_image_spans_matches(tiny, budget):
    llm = engine_for(tiny, max_num_batched_tokens=budget)
    cs = cases(tiny)
    ps = prompts(llm, cs)
    # the budget must actually split some image's placeholder run
    # (unless the model keeps image spans whole: Gemma 3's image tokens attend both ways)
    splits = any(it.offset // budget != (it.end - 1) // budget for p in ps for it in p.items)
    assert splits or llm.engine.model.mm_bidirectional
    check(tiny, cs, foveal_greedy(llm, ps, STEPS))


def test_repeated_image_hits_vision_cache(tiny):
    llm = engine_for(tiny)
    text, imgs = cases(tiny)[1]
    first = foveal_greedy(llm, prompts(llm, [(text, imgs)]), 4)[0]
    encoded = llm.engine.runner.num_encoded
    hits = llm.engine.encoder_cache.hits
    # the same pixels in a fresh PIL object: the content hash, not object identity, finds it
    again = foveal_greedy(llm, prompts(llm, [(text, [image(40, 30, 1)])]), 4)[0]
    assert llm.engine.runner.num_encoded == encoded, "the encoder ran for a cached image"
    assert llm.engine.encoder_cache.hits > hits
    assert again[1] == first[1] and torch.equal(again[0], first[0])
    # a different image with the same placeholder tokens is a miss
    foveal_greedy(llm, prompts(llm, [(text, [image(40, 30, 9)])]), 1)
    assert llm.engine.runner.num_encoded == encoded + 1


def test_encoder_budget_spreads_images_over_steps(tiny):
    # a budget of one embedding token: each step may start at most one new image
    llm = engine_for(tiny, max_encoder_tokens_per_step=1)
    cs = cases(tiny)[2:]
    per_step = []
    orig = llm.engine.model.encode_images

    def counting(items):
        per_step.append(len(items))
        return orig(items)

    llm.engine.model.encode_images = counting
    check(tiny, cs, foveal_greedy(llm, prompts(llm, cs), STEPS))
    assert per_step and max(per_step) == 1 and sum(per_step) == 2


def hub_name(n: str) -> str:
    """transformers-4.x safetensors naming of LLaVA-style checkpoints (llava-hf/*, google/gemma-3-*)."""
    if n.startswith("model.language_model."):
        return "language_model.model." + n.removeprefix("model.language_model.")
    if n.startswith("model.vision_tower.") and not n.startswith("model.vision_tower.vision_model."):
        return "vision_tower.vision_model." + n.removeprefix("model.vision_tower.")
    return n.removeprefix("model.") if n.startswith("model.") else "language_model." + n


def loaded_params(config, weights) -> dict:
    """Our model's parameters, built on the CPU from `weights` (name, tensor) pairs."""
    from foveal.attention import get_backend
    from foveal.models import build_model

    backend = get_backend("torch", "cpu")
    model = build_model(config, backend, max_positions=64, dtype=torch.float32, device="cpu", weights=weights)
    return dict(model.named_parameters())


@pytest.mark.parametrize("family", ["llava", "gemma3", "llava_onevision"])
def test_hub_style_checkpoint_names_load_identically(family, tmp_path):
    hf = build(family, str(tmp_path)).hf
    state = hf.state_dict()
    new = loaded_params(hf.config, state.items())
    hub = loaded_params(hf.config, ((hub_name(n), t) for n, t in state.items()))
    assert new.keys() == hub.keys() and all(torch.equal(new[k], hub[k]) for k in new)


def test_qwen3_vl_moe_published_expert_stacks_load_identically(tmp_path):
    """Qwen3-VL-MoE's Hub files hold each layer's experts as [E, H, 2I] and [E, I, H] (transformers 5
    transposes them on load): those load to the same model as transformers' own [E, 2I, H] layout."""
    hf = build("qwen3_vl_moe", str(tmp_path)).hf.model
    state = hf.state_dict()

    def published(n, t):
        stacked = n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        return t.transpose(1, 2).contiguous() if stacked else t

    assert any(t.shape[1] != t.shape[2] for n, t in state.items() if n.endswith("experts.gate_up_proj"))
    ours = loaded_params(hf.config, state.items())
    hub = loaded_params(hf.config, ((n, published(n, t)) for n, t in state.items()))
    assert ours.keys() == hub.keys() and all(torch.equal(ours[k], hub[k]) for k in ours)


def test_prefix_cache_hit_equals_miss_and_keys_on_image_content(tiny):
    """Same image: the second request reuses the cached blocks (image ones included) and generates what
    the uncached engine does. Different image, same placeholder tokens: no hit past the image start."""
    cold = engine_for(tiny)
    warm = engine_for(tiny, enable_prefix_caching=True)
    text, imgs = cases(tiny)[2]
    ((ref_logits, ref_toks, _),) = foveal_greedy(cold, prompts(cold, [(text, imgs)]), STEPS)
    foveal_greedy(warm, prompts(warm, [(text, imgs)]), STEPS)
    (p,) = prompts(warm, [(text, imgs)])
    ((logits, toks, _),) = foveal_greedy(warm, [p], STEPS)
    hit = len(p.prompt_token_ids) - logits.shape[0]
    assert hit >= len(p.prompt_token_ids) - 4, "the repeated prompt should be served from the cache"
    assert toks == ref_toks
    assert (logits - ref_logits[hit:]).abs().max().item() < TOL
    assert warm.engine.kv.hit_tokens >= hit
    # a different image with the same placeholder tokens: reuse stops at the first image's block
    other = [image(56, 56, 7), imgs[1]]
    (q,) = prompts(warm, [(text, other)])
    assert q.prompt_token_ids == p.prompt_token_ids
    ((logits2, toks2, _),) = foveal_greedy(warm, [q], STEPS)
    first_image_block = q.items[0].offset // warm.engine.kv.block_size
    assert len(q.prompt_token_ids) - logits2.shape[0] <= first_image_block * warm.engine.kv.block_size
    ((ref2, ref_toks2, _),) = foveal_greedy(cold, prompts(cold, [(text, other)]), STEPS)
    assert toks2 == ref_toks2


def test_system_prefix_is_found_in_an_image_chat(tiny):
    """--shared-prefix-cache on a VLM: the leading system turn, rendered alone through the family's
    processor, is a token prefix of the whole image chat (and the user turn's image lies after it)."""
    llm = engine_for(tiny)
    system = {"role": "system", "content": [{"type": "text", "text": "Answer briefly and politely."}]}
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}
    prompt = llm.processor.render_chat([system, user], images=[image(40, 30, 1)])
    ids = prompt.prompt_token_ids
    n = llm.processor.system_prefix_len([system, user], ids)
    assert 0 < n <= prompt.items[0].offset
    assert ids[:n] == llm.processor.apply_chat_template([system], add_generation_prompt=False)
    assert llm.processor.system_prefix_len([user], ids) == 0  # no system turn: nothing to share
