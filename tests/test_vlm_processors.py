"""The processor Foveal loads from a model folder writes the model's own image-token counts, for every
VLM family we serve: the same prompt ids and pixels as the processor the checkpoint was saved from,
and as many image tokens as the model gives embeddings for those pixels. transformers 5.25 silently
lost SmolVLM's saved `image_seq_len` on a load path Foveal had overridden (169 image tokens per crop
instead of the model's 4); this is the check that catches such a release at load time, whatever the
path (AutoProcessor, or the image-only processor built from its parts when torchvision is missing)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from foveal.loader.processors import load_hf_processor
from foveal.models import model_class
from tests.tiny_vlm import all_builders, image


@pytest.fixture(scope="module", params=sorted(all_builders()))
def saved(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return all_builders()[request.param](path)


def _prompt(tiny, n: int) -> str:
    return "<|user|>" + "".join(f"{tiny.image_text} picture {i}. " for i in range(n)) + "\n<|assistant|>"


def test_loaded_processor_writes_what_the_saved_one_wrote(saved):
    loaded = load_hf_processor(saved.path)
    assert loaded is not None
    hf = model_class_config(saved.path)
    adapter = model_class(hf).mm_adapter(hf)
    imgs = [image(40, 30, 1), image(28, 70, 3)]
    outs = []
    for proc in (saved.processor, loaded):
        outs.append(
            proc(text=[_prompt(saved, 2)], images=adapter.processor_images(imgs), return_tensors="pt")
        )
    want, got = outs
    assert got["input_ids"].tolist() == want["input_ids"].tolist()
    # the same pixels where both resize alike: a saved config may load as the other image-processor
    # backend (torchvision < 0.27 has no LANCZOS: Idefics3's saved processor loads as the PIL one)
    if type(loaded.image_processor) is type(saved.processor.image_processor):
        assert torch.equal(got["pixel_values"], want["pixel_values"])
    else:
        assert got["pixel_values"].shape == want["pixel_values"].shape


def test_image_tokens_match_the_models_embeddings(saved):
    hf = model_class_config(saved.path)
    adapter = model_class(hf).mm_adapter(hf)
    proc = load_hf_processor(saved.path)
    for imgs in ([image(40, 30, 1)], [image(56, 56, 2), image(28, 70, 3)]):
        out = proc(
            text=[_prompt(saved, len(imgs))], images=adapter.processor_images(imgs), return_tensors="pt"
        )
        items = adapter.split(out)
        assert len(items) == len(imgs)
        n_tokens = int((out["input_ids"][0] == adapter.image_token_id).sum())
        assert n_tokens == sum(n for _, n in items)
        # transformers' model takes these inputs: it refuses image tokens that its vision tower's
        # embeddings for these pixels do not fill one for one
        inputs = {k: v for k, v in out.items() if k != "attention_mask"}
        with torch.no_grad():
            saved.hf(**inputs)


def _plain(v):
    """A setting as JSON holds it: size dicts (transformers' SizeDict) as dicts, tuples as lists."""
    if hasattr(v, "keys"):
        return {k: _plain(x) for k, x in dict(v).items() if x is not None}
    return [_plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def test_saved_settings_are_the_ones_loaded(saved):
    """Every setting processor_config.json holds comes back as saved: the processor's own (SmolVLM's
    image_seq_len, Gemma 3's image_seq_length, LLaVA's patch_size ...) and its image processor's (sizes,
    merge and patch sizes, resampling)."""
    with open(os.path.join(saved.path, "processor_config.json")) as f:
        settings = json.load(f)
    loaded = load_hf_processor(saved.path)
    checked = 0
    for key, value in settings.items():
        if key in ("processor_class", "auto_map"):
            continue
        if key == "image_processor":
            for ikey, ivalue in value.items():
                if ikey != "image_processor_type":
                    assert _plain(getattr(loaded.image_processor, ikey)) == _plain(ivalue), ikey
                    checked += 1
        else:
            assert _plain(getattr(loaded, key)) == _plain(value), key
            checked += 1
    assert checked >= 5


def model_class_config(path: str):
    from foveal.loader.safetensors_loader import open_hf_folder

    return open_hf_folder(path).hf_config
