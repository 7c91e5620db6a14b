"""Write a random-weight vision-language checkpoint of a real model's shape, for benchmarks that must
not download weights: config from `benchmarks/configs/<name>.json` (public facts), the embedded
SmolLM2 tokenizer plus the family's special tokens, the family's real transformers processor.

    python benchmarks/make_dummy_vlm.py --config smolvlm-256m --out /tmp/smolvlm-256m-dummy

Only the SmolVLM shape is supported so far (its text model is SmolLM2-135M, our embedded tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SPECIALS = [
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]
TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def main() -> None:
    import transformers as tf
    from transformers.utils import is_torchvision_available

    from foveal.loader.default_model import default_model_path
    from foveal.loader.gguf_tokenizer import load_gguf_tokenizer
    from foveal.loader.processors import image_only_processor_class, image_processor_class

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="smolvlm-256m")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--longest-edge", type=int, default=None, help="processor resize target (SmolVLM: a multiple of 512)"
    )
    a = ap.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    spec = json.load(open(os.path.join(here, "configs", f"{a.config}.json")))
    if spec["model_type"] != "smolvlm":
        raise SystemExit(f"{a.config}: only smolvlm configs are supported")
    t0 = time.perf_counter()
    tok = load_gguf_tokenizer(default_model_path())
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = TEMPLATE
    text = tf.LlamaConfig(**{k: v for k, v in spec["text_config"].items() if k != "model_type"})
    text.vocab_size = len(tok)
    vision = tf.SmolVLMVisionConfig(**{k: v for k, v in spec["vision_config"].items() if k != "model_type"})
    cfg = tf.SmolVLMConfig(
        vision_config=vision,
        text_config=text,
        scale_factor=spec["scale_factor"],
        image_token_id=tok.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=spec["tie_word_embeddings"],
    )
    torch.manual_seed(0)
    model = tf.SmolVLMForConditionalGeneration(cfg).eval()
    model.config.architectures = ["SmolVLMForConditionalGeneration"]
    p = spec["processor"]
    ip = image_processor_class("SmolVLMImageProcessor")(
        do_image_splitting=True,
        size={"longest_edge": a.longest_edge or p["longest_edge"]},
        max_image_size={"longest_edge": p["max_image_size"]},
    )
    kw = dict(image_processor=ip, tokenizer=tok, image_seq_len=spec["image_seq_len"], chat_template=TEMPLATE)
    if is_torchvision_available():
        proc = tf.SmolVLMProcessor(video_processor=tf.SmolVLMVideoProcessor(), **kw)
    else:
        proc = image_only_processor_class(tf.SmolVLMProcessor)(**kw)
    model.save_pretrained(a.out)
    proc.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {a.out}: {n / 1e6:.0f}M parameters in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
