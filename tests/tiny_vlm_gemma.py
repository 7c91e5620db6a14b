"""Tiny Gemma 3 VLM for the parity tests: SigLIP tower (28 px images, 7 px patches: a 4x4 grid pooled
to 4 tokens), a 4-layer Gemma 3 decoder mixing sliding (window 8) and full layers, the real
Gemma3Processor and Gemma3ImageProcessor, and a byte tokenizer whose named specials (boi, image soft
token, eoi) are what the processor reads. Image spans (4 tokens) fit inside the window, where every
transformers version agrees on how the bidirectional and sliding masks combine."""

from __future__ import annotations

import torch

from tests.tiny import tiny_config
from tests.tiny_vlm import CHAT_TEMPLATE, TinyVLM, image_processor_class, perturb, save

BOI, IMAGE, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


def gemma_tokenizer():
    """The byte-level tokenizer of tiny_vlm.byte_tokenizer, plus the named specials Gemma3Processor
    reads (tokenizer.boi_token, .image_token, .eoi_token and their ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token=None,
        extra_special_tokens={"boi_token": BOI, "image_token": IMAGE, "eoi_token": EOI},
    )
    fast.chat_template = CHAT_TEMPLATE.replace("{{ IMAGE }}", BOI)
    return fast


def build_gemma3(path: str) -> TinyVLM:
    import transformers as tf

    tok = gemma_tokenizer()
    assert tok.image_token == IMAGE and tok.boi_token == BOI
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=28, patch_size=7, vision_use_head=False,
    )  # fmt: skip
    text = tiny_config(  # the tiny Gemma 3 text config of the decoder parity tests
        "gemma3",
        vocab_size=len(tok),
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    cfg = tf.Gemma3Config(
        vision_config=vision,
        text_config=text,
        mm_tokens_per_image=4,
        image_token_index=tok.convert_tokens_to_ids(IMAGE),
        boi_token_index=tok.convert_tokens_to_ids(BOI),
        eoi_token_index=tok.convert_tokens_to_ids(EOI),
    )
    torch.manual_seed(0)
    hf = tf.Gemma3ForConditionalGeneration(cfg).eval()
    perturb(hf)
    with torch.no_grad():  # zero-initialized: the projection must carry signal for the test to mean much
        proj = hf.model.multi_modal_projector.mm_input_projection_weight
        proj.copy_(torch.randn_like(proj) * 0.2)
    ip = image_processor_class("Gemma3ImageProcessor")(
        size={"height": 28, "width": 28}, do_pan_and_scan=False
    )
    proc = tf.Gemma3Processor(
        image_processor=ip, tokenizer=tok, image_seq_length=4, chat_template=tok.chat_template
    )
    save(hf, proc, path)
    return TinyVLM(path, hf, proc, proc.boi_token)


BUILDERS = {"gemma3": build_gemma3}
