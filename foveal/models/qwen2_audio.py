"""Qwen2-Audio: transformers' Whisper-style audio encoder (two convolutions, a transformer over 1,500
frames of a 30 s window, average pooling to 750), a linear projector, and a native Qwen2 decoder on the
paged KV cache. A clip's audio tokens are the pooled frames its samples fill: (((n - 1) // 2 + 1) - 2)
// 2 + 1 for n mel frames (transformers' processor expands the placeholder to that many).

Request side: the processor's Whisper feature extractor (numpy) turns 16 kHz samples into log-mel
features padded to 30 s, with a mask of the real frames; a clip longer than the window is refused
(the extractor would cut it silently).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foveal.models.vlm import ImageAdapter, MediaInput, VisionLanguageModel, hf_module


def audio_tokens(mel_frames: int) -> int:
    return (((mel_frames - 1) // 2 + 1) - 2) // 2 + 1


class Qwen2AudioAdapter(ImageAdapter):
    def __init__(self, hf_config, video_config: dict | None = None):
        self.config = hf_config
        self.image_token_id = None
        self.audio_token_id = int(hf_config.audio_token_id)

    def audio_inputs(self, clip, processor) -> MediaInput:
        fe = processor.feature_extractor
        if clip.sampling_rate != fe.sampling_rate:
            raise ValueError(f"audio must be sampled at {fe.sampling_rate} Hz, got {clip.sampling_rate}")
        if len(clip.samples) > fe.n_samples:
            raise ValueError(
                f"audio is {len(clip.samples) / fe.sampling_rate:.1f} s long; this model hears at most "
                f"{fe.n_samples / fe.sampling_rate:g} s a clip"
            )
        out = fe(
            [clip.samples], sampling_rate=fe.sampling_rate, return_attention_mask=True,
            padding="max_length", return_tensors="pt",
        )  # fmt: skip
        mask = out["attention_mask"]
        seconds = len(clip.samples) / clip.sampling_rate
        data = {"input_features": out["input_features"], "feature_attention_mask": mask, "seconds": seconds}
        return MediaInput(data, audio_tokens(int(mask.sum())))


class Qwen2AudioForConditionalGeneration(VisionLanguageModel):
    mm_adapter = Qwen2AudioAdapter
    PREFIXES = (
        (("model.language_model.", "language_model.model."), "text"),
        (("lm_head.", "language_model.lm_head."), "lm_head"),
        (("model.audio_tower.", "audio_tower."), "audio_tower"),
        (("model.multi_modal_projector.", "multi_modal_projector."), "multi_modal_projector"),
    )

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.multi_modal_projector = nn.ModuleDict(
            {"linear": nn.Linear(config.audio_config.d_model, config.text_config.hidden_size)}
        )
        self.audio_tower: nn.Module | None = None

    def build_vision(self, device, dtype) -> None:
        from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

        self.audio_tower = hf_module(
            lambda: Qwen2AudioEncoder._from_config(self.config.audio_config), device, dtype
        )

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One encoder pass over every clip (each padded to the 30 s window), the padded frames masked
        out of its attention as transformers masks them; each clip's first `audio_tokens` pooled frames."""
        from transformers.masking_utils import create_bidirectional_mask

        w = self.multi_modal_projector["linear"].weight
        feats = torch.cat([it["input_features"] for it in items]).to(device=w.device, dtype=w.dtype)
        mel = torch.cat([it["feature_attention_mask"] for it in items]).sum(-1).to(w.device)
        conv = (mel - 1) // 2 + 1  # frames after the strided convolution
        frames = (feats.shape[-1] - 2) // 2 + 1
        keep = (torch.arange(frames, device=w.device)[None, :] < conv[:, None]).long()
        dummy = torch.zeros(feats.shape[0], frames, 1, dtype=w.dtype, device=w.device)
        mask = create_bidirectional_mask(
            config=self.audio_tower.config, inputs_embeds=dummy, attention_mask=keep
        )
        hidden = self.audio_tower(feats, attention_mask=mask).last_hidden_state
        out = self.multi_modal_projector["linear"](hidden)
        return [out[i, : audio_tokens(int(n))] for i, n in enumerate(mel.tolist())]
