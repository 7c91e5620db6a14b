"""A tiny random Qwen2-Audio saved as a checkpoint folder (Whisper features, byte tokenizer), for the
audio tests (tests/test_audio_inputs.py, tests/test_server_audio.py)."""

from __future__ import annotations

import torch

from tests.tiny_vlm import byte_tokenizer, perturb, save, text_config_kwargs

AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"


def build_qwen2_audio(path: str):
    """(path, the transformers model, its processor)."""
    import transformers as tf

    specials = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]
    tok = byte_tokenizer(specials, "", audio_token=AUDIO)
    text = text_config_kwargs(len(tok))
    text.update(model_type="qwen2", bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = tf.Qwen2AudioConfig(
        audio_config=dict(
            d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=128,
            max_source_positions=1500,
        ),
        text_config=text,
        audio_token_id=tok.convert_tokens_to_ids("<|AUDIO|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    hf = tf.Qwen2AudioForConditionalGeneration(cfg).eval()
    perturb(hf)
    fe = tf.WhisperFeatureExtractor(feature_size=128)
    proc = tf.Qwen2AudioProcessor(feature_extractor=fe, tokenizer=tok, chat_template=tok.chat_template)
    save(hf, proc, path)
    return path, hf, proc
