"""Tiny Idefics3 and SmolVLM checkpoints for the VLM parity tests (see `tests/tiny_vlm.py`).

Both use image splitting: the processor resizes an image so its longest edge is `size`, rounds it up to
whole `max_image_size` squares, and cuts it into that grid of crops plus one global crop. With the sizes
below, 56x56 and 40x30 images make a 2x2 grid + global (5 crops) and 28x70 a 2x1 grid + global (3 crops);
each crop gives `image_seq_len` image tokens, between <fake_token_around_image>, <row_i_col_j> and
<global-img> markers that are text tokens of the prompt.

SmolVLMProcessor needs `num2words` (a project dependency) and, for its video processor,
torchvision: without torchvision the checkpoint carries it the way Foveal's loader falls back to,
image-only (`image_only_processor_class`).
"""

from __future__ import annotations

import torch

from tests.tiny_vlm import TinyVLM, byte_tokenizer, image_processor_class, perturb, save, text_config_kwargs

IMAGE = "<image>"
# what the processors insert around image tokens; the real tokenizers hold all of them as special tokens
SPECIALS = [
    IMAGE,
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]


def _smolvlm_processor(ip, tok, image_seq_len: int):
    import transformers as tf
    from transformers.utils import is_torchvision_available

    from foveal.loader.processors import image_only_processor_class

    kwargs = dict(
        image_processor=ip, tokenizer=tok, image_seq_len=image_seq_len, chat_template=tok.chat_template
    )
    if is_torchvision_available():
        # frames sized as the image processor sizes crops (a real SmolVLM2's are), not the video processor's
        # default 364 px: the tiny's image_seq_len counts a 56-px crop's embeddings, and transformers itself
        # fails on a clip whose frames give more
        vp = tf.SmolVLMVideoProcessor(size=dict(ip.size), max_image_size=dict(ip.max_image_size))
        return tf.SmolVLMProcessor(video_processor=vp, **kwargs)
    return image_only_processor_class(tf.SmolVLMProcessor)(**kwargs)


def _build(path: str, family: str) -> TinyVLM:
    import transformers as tf

    # SmolVLM2's template writes a video as "<video>", text its processor replaces (no token of its own)
    tok = byte_tokenizer(SPECIALS, IMAGE, video_token="<video>" if family == "smolvlm" else "")
    name = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}[family]  # transformers' class prefix
    if family == "idefics3":
        # crops of 28 px = 4x4 patches of 7 -> 4 tokens after the 2x2 pixel shuffle; untied LM head
        crop, patch, longest, tie = 28, 7, 56, False
    else:
        # crops of 56 px = 4x4 patches of 14 -> 4 tokens; the LM head tied to the embeddings by the
        # top-level flag, the one transformers reads (the text config's own flag stays False)
        crop, patch, longest, tie = 56, 14, 112, True
    scale = 2
    image_seq_len = (crop // patch) ** 2 // scale**2
    vision = getattr(tf, f"{name}VisionConfig")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=crop, patch_size=patch,
    )  # fmt: skip
    text = tf.LlamaConfig(**text_config_kwargs(len(tok)), tie_word_embeddings=False)
    cfg = getattr(tf, f"{name}Config")(
        vision_config=vision,
        text_config=text,
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    hf = getattr(tf, f"{name}ForConditionalGeneration")(cfg).eval()
    perturb(hf)
    ip = image_processor_class(f"{name}ImageProcessor")(
        do_image_splitting=True, size={"longest_edge": longest}, max_image_size={"longest_edge": crop}
    )
    if family == "idefics3":
        proc = tf.Idefics3Processor(
            image_processor=ip, tokenizer=tok, image_seq_len=image_seq_len, chat_template=tok.chat_template
        )
    else:
        proc = _smolvlm_processor(ip, tok, image_seq_len)
    save(hf, proc, path)
    return TinyVLM(path, hf, proc, IMAGE)


def build_idefics3(path: str) -> TinyVLM:
    return _build(path, "idefics3")


def build_smolvlm(path: str) -> TinyVLM:
    return _build(path, "smolvlm")


BUILDERS = {"idefics3": build_idefics3, "smolvlm": build_smolvlm}
