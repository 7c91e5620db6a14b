"""`--load-format dummy`: real-size model shapes from config JSONs alone (benchmarks/configs), random
weights, a synthetic tokenizer; the engine and the server run on them end to end."""

from __future__ import annotations

import json
import os

import pytest
import torch

from foveal import SamplingParams
from foveal.loader import dummy
from foveal.loader.errors import ModelLoadError

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "configs")


@pytest.mark.parametrize(
    "name, params",
    [("llama-3.1-8b", 8_030_261_248), ("qwen3-0.6b", 596_049_920), ("qwen2.5-vl-7b", 8_292_166_656)],
)
def test_benchmark_configs_build_the_published_shapes(name, params):
    """Our model built from each config (on the meta device: no memory) has the published parameter
    count, and so does transformers' own model of the same config."""
    import transformers as tf

    from foveal.attention import get_backend
    from foveal.models import model_class

    config = dummy.load_config(os.path.join(CONFIGS, f"{name}.json"))
    with torch.device("meta"):
        ours = model_class(config)(config, get_backend("torch", "cpu"), 1024)
        ours.reset_buffers(torch.device("meta"), torch.bfloat16)  # VLMs build their vision tower here
        vlm = config.get_text_config() is not config
        auto = tf.AutoModelForImageTextToText if vlm else tf.AutoModelForCausalLM
        theirs = auto.from_config(config)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == params


def test_synthetic_tokenizer_round_trips_and_knows_the_specials():
    config = dummy.load_config(os.path.join(CONFIGS, "qwen2.5-vl-7b.json"))
    tok = dummy.synthetic_tokenizer(config)
    assert len(tok) == config.get_text_config().vocab_size
    ids = tok.encode("t17 t942 t3", add_special_tokens=False)
    assert ids == [17, 942, 3] and tok.decode(ids) == "t17 t942 t3"
    assert tok.convert_tokens_to_ids("<|image_pad|>") == config.image_token_id
    assert tok.eos_token_id == config.get_text_config().eos_token_id
    msgs = [{"role": "user", "content": "t5"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nt5<|im_end|>\n<|im_start|>assistant\n"


def _tiny_json(tmp_path, family="llama"):
    from tests.tiny import tiny_config

    cfg = tiny_config(family)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]]
    path = tmp_path / f"tiny-{family}.json"
    path.write_text(json.dumps(cfg.to_dict()))
    return str(path)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_runs_a_dummy_model(tmp_path, family):
    from foveal.engine.llm import LLM

    llm = LLM(_tiny_json(tmp_path, family), load_format="dummy", num_blocks=64, block_size=4)
    assert llm.processor.info.model_name == f"tiny-{family}"
    weights = [p for n, p in llm.engine.model.named_parameters() if "norm" not in n]
    assert all(float(p.detach().float().std()) > 0.01 for p in weights)  # random, not zeros or constants
    out = llm.generate(["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6
    # words after the prompt's: each begins with the joining space
    assert out.outputs[0].text == "".join(f" t{i}" for i in out.outputs[0].token_ids)
    assert llm.engine.kv.num_used_blocks == 0


def test_per_request_kv_limit_is_checked_at_admission(tmp_path):
    """--max-request-kv-tokens caps prompt + max_tokens below the context (a 400 at the HTTP edge, a
    ValueError naming the flag here); an unset max_tokens fills what is left under the cap."""
    from foveal.engine.llm import LLM

    llm = LLM(
        _tiny_json(tmp_path), load_format="dummy", num_blocks=64, block_size=4, max_request_kv_tokens=24
    )
    eng, info = llm.engine, llm.processor.info
    assert info.max_model_len > 24 and info.max_request_tokens == 24
    prompt = [5] * 20
    with pytest.raises(ValueError, match="max-request-kv-tokens"):
        llm.processor.request(prompt, SamplingParams(max_tokens=5))
    with pytest.raises(ValueError, match="per-request KV limit of 24"):
        llm.processor.request([5] * 24, SamplingParams(max_tokens=1))
    out = llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=None))[0]
    assert len(out.outputs[0].token_ids) == 4
    assert eng.kv.num_used_blocks == 0
    with pytest.raises(ValueError, match="max_request_kv_tokens"):
        LLM(_tiny_json(tmp_path), load_format="dummy", num_blocks=64, max_request_kv_tokens=1)


def test_dummy_vlm_processes_an_image(tmp_path):
    """A Qwen2.5-VL config (tiny) gets its family's processor from defaults: a 448x448 image is 256
    placeholders, and the engine generates from it."""
    import transformers as tf
    from PIL import Image

    from foveal.engine.llm import LLM
    from tests.tiny_vlm_qwen import qwen_config, text_config_kwargs

    text = text_config_kwargs(200)
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  hidden_size=16, intermediate_size=32, out_hidden_size=text["hidden_size"], window_size=56,
                  fullatt_block_indexes=[0])  # fmt: skip
    ids = {"<|image_pad|>": 190, "<|video_pad|>": 191, "<|vision_start|>": 192, "<|vision_end|>": 193}
    cfg = qwen_config(tf.Qwen2_5_VLConfig, text, vision, ids)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    path = tmp_path / "tiny-qwen2.5-vl.json"
    path.write_text(json.dumps(cfg.to_dict()))
    llm = LLM(str(path), load_format="dummy", num_blocks=128, block_size=16)
    g = torch.Generator().manual_seed(0)
    img = Image.fromarray(torch.randint(0, 256, (448, 448, 3), generator=g, dtype=torch.uint8).numpy())
    mm = llm.processor.render_chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "t5 t6"}]}], images=[img]
    )
    assert mm.prompt_token_ids.count(190) == 256 and len(mm.items) == 1
    out = llm.generate([mm], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    # and a clip: the synthetic chat template places a video part as the family's template does
    from foveal.request import VideoClip

    frames = torch.randint(0, 256, (4, 112, 112, 3), generator=g, dtype=torch.uint8).numpy()
    vid = llm.processor.render_chat(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "t5"}]}],
        videos=[VideoClip(frames, 2.0, "clip")],
    )
    assert len(vid.items) == 1 and vid.prompt_token_ids.count(191) > 0
    assert vid.prompt_token_ids.count(190) == 0
    out = llm.generate([vid], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_dummy_needs_a_config(tmp_path):
    from foveal.engine.llm import LLM

    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(None, load_format="dummy")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ModelLoadError, match="could not read a model config"):
        LLM(str(bad), load_format="dummy")
