"""Qwen2.5-Omni's thinker: the half of Qwen2.5-Omni that reads text, images, videos and audio and writes
text (the talker and token2wav, which speak that text, are not loaded). transformers' vision tower
(Qwen2.5-VL's, with window attention) and audio encoder (Whisper-style convolutions and transformer,
attending within chunks of 2 x n_window mel frames, pooled 2:1 and projected to the decoder's width) run
once per item; the decoder is the native Qwen2 with M-RoPE of models/qwen2_vl.py.

Positions, as transformers' `get_rope_index` gives them: an image's or a video's tokens take grid
positions as in Qwen2.5-VL, a video's time axis in seconds (position_id_per_seconds positions a second,
a setting of the thinker's config, not the tower's); audio tokens advance all three axes together, as
text does; the text after any span resumes one past its largest position. A prompt with audio but no
image or video has plain 1-D positions.

Request side: images through the processor; videos as Qwen2.5-VL's (models/qwen_video.py), frames sized
as the Omni processor sizes them, over the folder's settings; audio through the processor's Whisper
feature extractor as Qwen2-Audio's, keeping only a clip's real mel frames (the encoder never sees the
padding). A video's own sound interleaved with its frames (transformers' `use_audio_in_video`) is not
supported: a `VideoClip` carries no audio.

Checkpoints: the thinker alone (`Qwen2_5OmniThinkerForConditionalGeneration`) or the whole model
(`Qwen2_5OmniForConditionalGeneration`: the thinker's tensors under `thinker.`, the talker's and
token2wav's skipped).
"""

from __future__ import annotations

from typing import Any

import torch

from foveal.models.qwen2_audio import Qwen2AudioAdapter, audio_tokens
from foveal.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, QwenVideoAdapter
from foveal.models.vision_attention import use_segment_attention
from foveal.models.vlm import MediaInput, hf_module

# the whole model's speech half: its tensors have no place here
_SPEECH_PREFIXES = ("talker.", "token2wav.")
# transformers' Omni processor passes this frame size to its video processor on every call, so it holds
# over the folder's settings (the published folder has only the image processor's 3,136..12,845,056)
_VIDEO_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}


def thinker_config(config):
    """The thinker's config; the whole model's config holds it as `thinker_config`."""
    thinker = getattr(config, "thinker_config", None)
    return config if thinker is None else thinker


class Qwen2_5OmniAdapter(QwenVideoAdapter):
    """Images and videos as Qwen2.5-VL's, audio clips as Qwen2-Audio's."""

    def __init__(self, hf_config, video_config: dict | None = None):
        config = thinker_config(hf_config)
        video = {k: v for k, v in (video_config or {}).items() if k not in ("min_pixels", "max_pixels")}
        super().__init__(config, {**video, "size": _VIDEO_SIZE})
        self.audio_token_id = int(config.audio_token_id)
        self.tokens_per_second = config.position_id_per_seconds

    def audio_inputs(self, clip, processor) -> MediaInput:
        media = Qwen2AudioAdapter.audio_inputs(self, clip, processor)
        frames = int(media.data["feature_attention_mask"].sum())
        data = {
            "input_features": media.data["input_features"][..., :frames].contiguous(),
            "seconds": media.data["seconds"],
        }
        return MediaInput(data, media.num_embeds)

    def rope(self, prompt_ids: list[int], items: list):
        vision = [it for it in items if it.modality != "audio"]  # audio is positioned as text
        return super().rope(prompt_ids, vision) if vision else None


class Qwen2_5OmniThinkerForConditionalGeneration(Qwen2_5_VLForConditionalGeneration):
    mm_adapter = Qwen2_5OmniAdapter
    vision_class = "qwen2_5_omni.modeling_qwen2_5_omni:Qwen2_5OmniVisionEncoder"
    # transformers 5 names (`model.language_model.`, ...) first, then the published layout whose decoder
    # is the top-level `model.` (so that prefix must come last); the whole model's `thinker.` is dropped
    PREFIXES = (
        (("model.language_model.",), "text"),
        (("model.visual.", "visual."), "visual"),
        (("model.audio_tower.", "audio_tower."), "audio_tower"),
        (("lm_head.",), "lm_head"),
        (("model.",), "text"),
    )

    def __init__(self, config, backend, max_positions: int):
        super().__init__(thinker_config(config), backend, max_positions)
        self.audio_tower: torch.nn.Module | None = None

    def build_vision(self, device, dtype) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

        super().build_vision(device, dtype)
        tower = hf_module(
            lambda: Qwen2_5OmniAudioEncoder._from_config(self.config.audio_config), device, dtype
        )
        self.audio_tower = use_segment_attention(tower)  # one attention call a layer, not one a chunk

    def load_weight(self, filler, name: str, tensor: torch.Tensor, own: dict | None = None) -> None:
        if not name.startswith(_SPEECH_PREFIXES):
            super().load_weight(filler, name.removeprefix("thinker."), tensor, own)

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Images and videos in one vision tower pass, audio clips in one audio encoder pass."""
        audio = [i for i, it in enumerate(items) if "input_features" in it]
        vision = [i for i, it in enumerate(items) if "input_features" not in it]
        out: list[torch.Tensor] = [None] * len(items)  # type: ignore[list-item]
        for idx, encode in ((vision, super().encode_images), (audio, self.encode_audio)):
            if idx:
                for i, emb in zip(idx, encode([items[i] for i in idx])):
                    out[i] = emb
        return out

    def encode_audio(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Every clip's mel frames side by side [mel, sum of frames], as transformers passes them: the
        encoder cuts each clip into its own chunks and attends within a chunk, so batching changes nothing."""
        w = self.audio_tower.conv1.weight
        feats = [it["input_features"][0] for it in items]
        frames = torch.tensor([f.shape[-1] for f in feats], device=w.device)
        x = torch.cat(feats, dim=-1).to(device=w.device, dtype=w.dtype)
        out = self.audio_tower(x, feature_lens=frames, aftercnn_lens=(frames - 1) // 2 + 1).last_hidden_state
        return list(out.split([audio_tokens(n) for n in frames.tolist()]))
