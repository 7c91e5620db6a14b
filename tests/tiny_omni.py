"""A tiny random Qwen2.5-Omni thinker saved as a checkpoint folder, for tests/test_omni.py: real
transformers config, model and processor classes (Qwen2.5-VL's tower with window attention, the Omni
audio encoder, Whisper features), a byte tokenizer carrying the processor's named tokens. See
tests/tiny_vlm.py for the shared machinery.

The audio encoder attends within chunks of 2 x n_window = 16 mel frames (the real model: 200), so a
1.3 s clip is 9 chunks, the last one short; the feature extractor's window is 5 s (the real one's: 300 s).
`save_whole_model` writes the same thinker in the published layout of the whole model: its tensors under
`thinker.` (the decoder as the top-level `model.`), beside talker and token2wav tensors.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_vlm import TinyVLM, byte_tokenizer, image_processor_class, perturb, save, text_config_kwargs

IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"
AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
# the processor reads these from the tokenizer by name
NAMED = {
    "vision_bos_token": "<|vision_bos|>",
    "image_token": "<|IMAGE|>",
    "vision_eos_token": "<|vision_eos|>",
    "video_token": "<|VIDEO|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_token": "<|AUDIO|>",
    "audio_eos_token": "<|audio_eos|>",
}


def _tokenizer():
    from transformers import PreTrainedTokenizerFast

    plain = byte_tokenizer(list(NAMED.values()), IMAGE, VIDEO, AUDIO)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=plain.backend_tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens=NAMED,
    )  # fmt: skip
    tok.chat_template = plain.chat_template
    return tok


def build_qwen2_5_omni(path: str) -> TinyVLM:
    import transformers as tf
    from packaging.version import Version
    from transformers.utils import is_torchvision_available

    from foveal.loader.processors import image_only_processor_class, load_hf_processor

    if not is_torchvision_available() and Version(tf.__version__) < Version("5.23"):
        pytest.skip("before transformers 5.23 Qwen2.5-Omni's processor needs its video half (torchvision)")
    tok = _tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in NAMED.items()}
    text = text_config_kwargs(len(tok))
    text.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # head_dim 16: mrope_section covers head_dim/2 = 8 frequency pairs, split temporal/height/width
    text["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    vision = dict(
        depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1], out_hidden_size=text["hidden_size"],
    )  # fmt: skip
    audio = dict(
        d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64, num_mel_bins=128,
        max_source_positions=64, n_window=8, output_dim=text["hidden_size"],
    )  # fmt: skip
    cfg = tf.Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        image_token_index=ids["image_token"], video_token_index=ids["video_token"],
        audio_token_index=ids["audio_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"], vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = tf.Qwen2_5OmniThinkerForConditionalGeneration(cfg).eval()
    perturb(hf)
    ip = image_processor_class("Qwen2VLImageProcessor")(
        size={"shortest_edge": 56 * 56, "longest_edge": 112 * 112},
        patch_size=14, merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    parts = dict(
        image_processor=ip, feature_extractor=tf.WhisperFeatureExtractor(feature_size=128, chunk_length=5)
    )
    proc_cls = tf.Qwen2_5OmniProcessor
    if is_torchvision_available():
        parts["video_processor"] = tf.Qwen2VLVideoProcessor()
    else:  # as Foveal's loader does: the video processor needs torchvision
        proc_cls = image_only_processor_class(proc_cls)
    save(hf, proc_cls(tokenizer=tok, chat_template=tok.chat_template, **parts), path)
    return TinyVLM(path, hf, load_hf_processor(path), IMAGE)


def save_whole_model(tiny: TinyVLM, path: str) -> None:
    """The thinker of `tiny` as the whole model's checkpoint (Qwen2_5OmniForConditionalGeneration), with
    its processor files."""
    import transformers as tf
    from safetensors.torch import save_file

    renamed = {
        "model.language_model.": "model.",
        "model.visual.": "visual.",
        "model.audio_tower.": "audio_tower.",
    }
    tensors = {}
    for name, t in tiny.hf.state_dict().items():
        old = next((p for p in renamed if name.startswith(p)), "")
        tensors["thinker." + renamed.get(old, "") + name[len(old) :]] = t.contiguous()
    tensors["talker.model.embed_tokens.weight"] = torch.zeros(4, 8)
    tensors["token2wav.code2wav_dit_model.proj_out.weight"] = torch.zeros(2, 8)
    cfg = tf.Qwen2_5OmniConfig(thinker_config=tiny.hf.config.to_dict())
    cfg.architectures = ["Qwen2_5OmniForConditionalGeneration"]
    cfg.save_pretrained(path)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    tiny.processor.save_pretrained(path)
