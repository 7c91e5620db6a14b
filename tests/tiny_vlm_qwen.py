"""Tiny Qwen2-VL and Qwen2.5-VL (M-RoPE decoder, flattened-patch vision towers with patch merger; 2.5
with window attention) for the VLM parity tests. See tests/tiny_vlm.py for the shared machinery.

Image sizes: the processor resizes to multiples of 28 px (patch 14 x merge 2) with at least 56x56 and at
most 112x112 px, so test pictures of 28..112 px become 2x2..4x4 merged tokens, some non-square (h != w,
which M-RoPE positions must respect). Qwen2.5's window (56 px = 2x2 merged tokens) splits those grids
into several windows, some padded.
"""

from __future__ import annotations

import torch

from tests.tiny_vlm import TinyVLM, byte_tokenizer, image_processor_class, perturb, save, text_config_kwargs

IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_TEXT = "<|vision_start|><|video_pad|><|vision_end|>"
SPECIALS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]


class _HFReference:
    """The transformers model, called the way `tests.tiny_vlm.hf_greedy` calls it (the prompt's processor
    outputs with ever longer input_ids). The processor's `mm_token_type_ids` covers only the prompt;
    generated tokens are text, so they are padded with 0 (what `generate` does) before the call."""

    def __init__(self, model):
        self.model = model
        self.config = model.config

    def __call__(self, input_ids, **inputs):
        tt = inputs.get("mm_token_type_ids")
        if tt is not None and tt.shape[1] < input_ids.shape[1]:
            pad = tt.new_zeros(tt.shape[0], input_ids.shape[1] - tt.shape[1])
            inputs["mm_token_type_ids"] = torch.cat([tt, pad], dim=1)
        return self.model(input_ids=input_ids, **inputs)


def qwen_config(cfg_cls, text: dict, vision: dict, ids: dict):
    """A Qwen-VL family config whose special token ids are the byte tokenizer's (untied head)."""
    return cfg_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _build(path: str, family: str) -> TinyVLM:
    import transformers as tf
    from transformers.utils import is_torchvision_available

    from foveal.loader.processors import image_only_processor_class

    tok = byte_tokenizer(SPECIALS, IMAGE_TEXT, VIDEO_TEXT)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = text_config_kwargs(len(tok))
    text.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # head_dim 16: mrope_section covers head_dim/2 = 8 frequency pairs, split temporal/height/width
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=text["hidden_size"], mlp_ratio=2)
        cfg_cls = tf.Qwen2VLConfig
        model_cls, proc_cls = tf.Qwen2VLForConditionalGeneration, tf.Qwen2VLProcessor
    else:
        vision.update(
            hidden_size=32, intermediate_size=64, out_hidden_size=text["hidden_size"],
            window_size=56, fullatt_block_indexes=[1],
        )  # fmt: skip
        cfg_cls = tf.Qwen2_5_VLConfig
        model_cls, proc_cls = tf.Qwen2_5_VLForConditionalGeneration, tf.Qwen2_5_VLProcessor
    cfg = qwen_config(cfg_cls, text, vision, ids)
    torch.manual_seed(0)
    hf = model_cls(cfg).eval()
    perturb(hf)
    ip = image_processor_class("Qwen2VLImageProcessor")(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        patch_size=14, merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    kw = {}
    if is_torchvision_available():  # transformers then insists on the video processor too
        kw["video_processor"] = tf.Qwen2VLVideoProcessor()
    else:  # as Foveal's loader does: the video processor needs torchvision
        proc_cls = image_only_processor_class(proc_cls)
    proc = proc_cls(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template, **kw)
    save(hf, proc, path)
    return TinyVLM(path, _HFReference(hf), proc, IMAGE_TEXT)


def build_qwen2_vl(path: str) -> TinyVLM:
    return _build(path, "qwen2_vl")


def build_qwen2_5_vl(path: str) -> TinyVLM:
    return _build(path, "qwen2_5_vl")


BUILDERS = {"qwen2_vl": build_qwen2_vl, "qwen2_5_vl": build_qwen2_5_vl}
