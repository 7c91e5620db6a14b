"""Tiny Qwen3-VL (dense) for the VLM parity tests: interleaved M-RoPE Qwen3 decoder and DeepStack (the
vision tower's features of blocks 0 and 1 are added after decoder layers 0 and 1 of 3, so one layer runs
without). See tests/tiny_vlm.py for the shared machinery.

Image sizes: the processor resizes to multiples of 32 px (patch 16 x merge 2) with at least 64x64 and at
most 128x128 px: the test pictures (40x30, 56x56, 28x70) become 2x3, 2x2 and 4x2 merged tokens. The
learned 4x4 position table is resampled to each of those grids.
"""

from __future__ import annotations

import torch

from tests.tiny_vlm import TinyVLM, byte_tokenizer, image_processor_class, perturb, save, text_config_kwargs
from tests.tiny_vlm_qwen import IMAGE_TEXT, SPECIALS, _HFReference, qwen_config


def build_qwen3_vl(path: str, moe: bool = False) -> TinyVLM:
    import transformers as tf
    from transformers.utils import is_torchvision_available

    from foveal.loader.processors import image_only_processor_class

    tok = byte_tokenizer(SPECIALS, IMAGE_TEXT)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    text = text_config_kwargs(len(tok))
    text.update(
        num_hidden_layers=3, head_dim=16, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    # head_dim 16: 8 frequency pairs, interleaved t h w t h w t t (consecutive would be t t t t h h w w)
    text["rope_parameters"] = dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
    )
    vision = dict(
        depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )  # fmt: skip
    if moe:  # 6 experts of 48 (not square: the published stacks are [E, H, 2I]), top 2; layer 2 dense
        text.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[2])
    config_cls = tf.Qwen3VLMoeConfig if moe else tf.Qwen3VLConfig
    cfg = qwen_config(config_cls, text, vision, ids)
    torch.manual_seed(0)
    model_cls = tf.Qwen3VLMoeForConditionalGeneration if moe else tf.Qwen3VLForConditionalGeneration
    hf = model_cls(cfg).eval()
    perturb(hf)
    ip = image_processor_class("Qwen2VLImageProcessor")(
        size={"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        patch_size=16, merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    proc_cls, kw = tf.Qwen3VLProcessor, {}
    if is_torchvision_available():  # transformers then insists on the video processor too
        kw["video_processor"] = tf.Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2)
    else:  # as Foveal's loader does: the video processor needs torchvision
        proc_cls = image_only_processor_class(proc_cls)
    proc = proc_cls(image_processor=ip, tokenizer=tok, chat_template=tok.chat_template, **kw)
    save(hf, proc, path)
    return TinyVLM(path, _HFReference(hf), proc, IMAGE_TEXT)


def build_qwen3_vl_moe(path: str) -> TinyVLM:
    return build_qwen3_vl(path, moe=True)


BUILDERS = {"qwen3_vl": build_qwen3_vl, "qwen3_vl_moe": build_qwen3_vl_moe}
