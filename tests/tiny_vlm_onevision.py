"""A tiny LLaVA-OneVision checkpoint for the VLM parity tests (see `tests/tiny_vlm.py`).

SigLIP tiles of 28 px in patches of 7 (4 x 4 features a tile), grids from the pinpoints below, and
"anyres_max_2": a grid holding more than 2 tiles' worth of features after unpadding is shrunk
bilinearly. The test images (40x30, 56x56, 28x70) take a 1x2 grid (no shrink), a 2x2 grid (shrunk) and a
3x1 grid (shrunk), each plus the base tile.

LlavaOnevisionProcessor has a video processor, which needs torchvision: without it the checkpoint
carries the processor the way Foveal's loader falls back to, image-only (videos are Foveal's to
preprocess either way).
"""

from __future__ import annotations

import torch

from tests.tiny_vlm import TinyVLM, byte_tokenizer, image_processor_class, perturb, save, text_config_kwargs

IMAGE, VIDEO = "<image>", "<video>"
TILE, PATCH = 28, 7
PINPOINTS = [[28, 28], [28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]


def build_onevision(path: str) -> TinyVLM:
    import transformers as tf
    from transformers.utils import is_torchvision_available

    from foveal.loader.processors import image_only_processor_class

    tok = byte_tokenizer([IMAGE, VIDEO], IMAGE, video_token=VIDEO)
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=TILE,
        patch_size=PATCH,
    )  # fmt: skip
    text = tf.Qwen2Config(**text_config_kwargs(len(tok)), tie_word_embeddings=False)
    cfg = tf.LlavaOnevisionConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(IMAGE),
        video_token_index=tok.convert_tokens_to_ids(VIDEO),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        vision_aspect_ratio="anyres_max_2",
        image_grid_pinpoints=PINPOINTS,
    )
    torch.manual_seed(0)
    hf = tf.LlavaOnevisionForConditionalGeneration(cfg).eval()
    perturb(hf)
    with torch.no_grad():
        hf.model.image_newline.normal_()
    ip = image_processor_class("LlavaOnevisionImageProcessor")(
        size={"height": TILE, "width": TILE}, image_grid_pinpoints=PINPOINTS
    )
    kwargs = dict(
        image_processor=ip, tokenizer=tok, num_image_tokens=(TILE // PATCH) ** 2,
        vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_2",
        chat_template=tok.chat_template,
    )  # fmt: skip
    if is_torchvision_available():
        proc = tf.LlavaOnevisionProcessor(
            video_processor=tf.LlavaOnevisionVideoProcessor(size={"height": TILE, "width": TILE}), **kwargs
        )
    else:
        proc = image_only_processor_class(tf.LlavaOnevisionProcessor)(**kwargs)
    save(hf, proc, path)
    return TinyVLM(path, hf, proc, IMAGE)


BUILDERS = {"llava_onevision": build_onevision}
