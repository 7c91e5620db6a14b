"""Qwen2-VL and Qwen2.5-VL: transformers' vision tower (flattened patches of any image size, 2-D rotary,
patch merger; 2.5 adds window attention) run once per image, and a native Qwen2 decoder (q/k/v bias)
whose rotary is M-RoPE: every token has a (temporal, height, width) position.

Positions: text tokens advance all three axes together; the tokens of an image of t x h x w merged
cells get (t, h, w) grid coordinates offset by the position where the image starts, and the text after
it resumes at start + max(h, w). The prompt's [3, L] table is computed on the request side (the
adapter's `rope`, an `MRope`); generated tokens sit at p + delta on every axis, delta = max position
+ 1 - L. A text-only request has no table and delta 0: plain 1-D positions, as in transformers. The
runner asks the model (`MRopePositions`) for each step's positions; it never reads the table.

Videos (Qwen2-VL, Qwen2.5-VL): sampled frames become temporal patches (models/qwen_video.py) that run
through the same tower; their tokens get grid positions whose time axis counts temporal patches (2.5:
scaled to seconds, tokens_per_second positions a second).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from foveal.layers.rotary import MRotaryEmbedding
from foveal.models.llama import Qwen2ForCausalLM
from foveal.models.qwen_video import QwenVideoConfig, frame_indices, video_patches
from foveal.models.vision_attention import use_segment_attention
from foveal.models.vlm import ImageAdapter, MediaInput, VisionLanguageModel, hf_module


class MRopeQwen2ForCausalLM(Qwen2ForCausalLM):
    """The Qwen2 decoder with M-RoPE: `positions` are [3, T] (or [T], the same on all axes).

    A VLM config keeps `tie_word_embeddings` on the outer config (transformers 5), so it is passed in."""

    def __init__(self, config, backend, max_positions: int, *, tie_embeddings: bool):
        self.tie_embeddings = tie_embeddings  # read by _spec during the base constructor
        super().__init__(config, backend, max_positions)
        self.rotary = MRotaryEmbedding(config, self.spec.head_dim, max_positions)

    def _spec(self, config):
        spec = super()._spec(config)
        spec.tie_embeddings = self.tie_embeddings
        return spec

    def reset_buffers(self, device, dtype=None) -> None:
        self.rotary = MRotaryEmbedding(self.config, self.spec.head_dim, self.rotary.cos.shape[0]).to(device)


class MRope(NamedTuple):
    """A prompt's M-RoPE positions: the [3, L] table, and the shift of every later token."""

    table: torch.Tensor
    delta: int


class MRopePositions:
    """The M-RoPE families' answer to the runner's position questions (models/base.py)."""

    uses_mrope = True

    def rope_positions(self, spans: list[tuple[int, int, MRope | None]]) -> torch.Tensor:
        """[3, T]: prompt positions from the request's table; later tokens at p + delta on all axes."""
        parts = []
        for a, b, rope in spans:
            n_tab = 0 if rope is None else rope.table.shape[1]
            if a < n_tab:
                parts.append(rope.table[:, a : min(b, n_tab)])
            lo = max(a, n_tab)
            if lo < b:
                parts.append(torch.arange(lo, b).add_(rope.delta if rope else 0).expand(3, -1))
        return torch.cat(parts, dim=1)

    def position_shift(self, rope: MRope | None) -> int:
        return rope.delta if rope is not None else 0


def mrope_prompt_positions(
    length: int, spans: list[tuple[int, tuple[int, int, int], float]], merge: int
) -> MRope:
    """[3, length] positions and the delta for a prompt whose images and videos sit at `spans`: (offset,
    grid t/h/w in patches, temporal step), in prompt order. Every image or video token is one merged
    cell of its grid; a video's temporal patch i sits at int(i * step) (Qwen2.5-VL: step = tokens per
    second x seconds per temporal patch; Qwen2-VL and images: 1). The text after a span resumes one past
    the span's largest position (the Qwen rule: transformers since 5.3 resumes at start + max(h, w)
    instead, which differs only for a video whose time axis outruns its height and width)."""
    pos = torch.empty(3, length, dtype=torch.long)
    cur = 0  # the next text position
    text_start = 0
    for offset, (t, h, w), step in spans:
        n = offset - text_start
        pos[:, text_start:offset] = torch.arange(cur, cur + n)
        cur += n
        h, w = h // merge, w // merge
        cells = t * h * w
        span = pos[:, offset : offset + cells]
        span[0] = (torch.arange(t, dtype=torch.float64) * step).long().repeat_interleave(h * w)
        span[1] = torch.arange(h).repeat_interleave(w).repeat(t)
        span[2] = torch.arange(w).repeat(t * h)
        span += cur
        cur += max(int(span[0, -1]) - cur + 1, h, w)
        text_start = offset + cells
    pos[:, text_start:] = torch.arange(cur, cur + length - text_start)
    delta = int(pos.max()) + 1 - length if length else 0
    return MRope(pos, delta)


# a clip's encoder work per item (video_parts): with the scheduler's encoder budget per step
# (max_encoder_tokens_per_step) it bounds how much of a clip one step encodes
VIDEO_PART_EMBEDS = 2048


class Qwen2VLAdapter(ImageAdapter):
    """The processor returns all images' patches as one [sum t*h*w, C*T*P*P] tensor plus a [N, 3] grid;
    image i owns the next t*h*w rows and takes t*h*w / merge^2 placeholder tokens."""

    def __init__(self, hf_config, video_config: dict | None = None):
        super().__init__(hf_config)
        self.merge = int(hf_config.vision_config.spatial_merge_size)

    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        pv, grid = out["pixel_values"], out["image_grid_thw"]
        parts, row = [], 0
        for i in range(grid.shape[0]):
            n = int(grid[i].prod())
            parts.append(
                ({"pixel_values": pv[row : row + n], "image_grid_thw": grid[i : i + 1]}, n // self.merge**2)
            )
            row += n
        if row != pv.shape[0]:
            raise ValueError(f"image grids cover {row} patches but the processor gave {pv.shape[0]}")
        return parts

    def video_parts(self, media: MediaInput) -> list[MediaInput]:
        """Runs of whole temporal patches of about VIDEO_PART_EMBEDS embeddings: the tower attends within
        one temporal patch at a time (its cu_seqlens), so the parts encode to the clip's embeddings. Each
        part's `video_t0` (its first temporal patch) lets rope() place it inside its clip."""
        data = media.data
        t, h, w = (int(x) for x in data["video_grid_thw"][0])
        cells = h * w // self.merge**2
        per = max(1, VIDEO_PART_EMBEDS // cells)
        if t <= per:
            return [media]
        pixels, rows = data["pixel_values_videos"], h * w
        parts = []
        for t0 in range(0, t, per):
            k = min(per, t - t0)
            part = dict(data, pixel_values_videos=pixels[t0 * rows : (t0 + k) * rows])
            part.update(video_grid_thw=torch.tensor([[k, h, w]]), video_t0=torch.tensor([t0]))
            # Qwen3-VL: each part's text is its own frames' (the caller splits the clip's text as it goes)
            parts.append(MediaInput(part, k * cells, media.text))
        return parts

    def _temporal_step(self, it) -> float:
        return 1.0

    def rope(self, prompt_ids: list[int], items: list) -> MRope:
        spans = []
        for it in sorted(items, key=lambda it: it.offset):
            video = it.modality == "video"
            t, h, w = (int(x) for x in it.data["video_grid_thw" if video else "image_grid_thw"][0])
            if it.embed_index is not None or it.length != t * h * w // self.merge**2:
                raise ValueError(
                    f"{it.modality} span of {it.length} tokens does not match its grid {t}x{h}x{w}"
                )
            t0 = int(it.data["video_t0"][0]) if video and "video_t0" in it.data else 0
            if t0:  # a later part of the clip just before it (video_parts): that span grows
                offset, (tp, hp, wp), step = spans[-1]
                if offset + tp * hp * wp // self.merge**2 != it.offset or (tp, hp, wp) != (t0, h, w):
                    raise ValueError(f"video part at temporal patch {t0} does not follow its clip's start")
                spans[-1] = (offset, (t0 + t, h, w), step)
                continue
            spans.append((it.offset, (t, h, w), self._temporal_step(it) if video else 1.0))
        return mrope_prompt_positions(len(prompt_ids), spans, self.merge)


class QwenVideoAdapter(Qwen2VLAdapter):
    """Qwen2-VL and Qwen2.5-VL: images, and videos as temporal patches of their sampled frames
    (models/qwen_video.py). Qwen2.5-VL spaces a video's temporal positions by time: tokens_per_second
    positions per second of the clip."""

    def __init__(self, hf_config, video_config: dict | None = None):
        super().__init__(hf_config)
        self.video_token_id = int(hf_config.video_token_id)
        self.video = QwenVideoConfig.from_dict(video_config)
        self.tokens_per_second = getattr(hf_config.vision_config, "tokens_per_second", None)

    def frame_indices(self, total_frames, video_fps, **sampling):
        return frame_indices(self.video, total_frames, video_fps, **sampling)

    def video_inputs(self, clip, processor=None) -> MediaInput:
        if not clip.fps > 0:
            raise ValueError(f"a video's frame rate must be positive, got {clip.fps}")
        frames = torch.from_numpy(clip.frames) if not isinstance(clip.frames, torch.Tensor) else clip.frames
        patches, (t, h, w) = video_patches(self.video, frames)
        data = {
            "pixel_values_videos": patches,
            "video_grid_thw": torch.tensor([[t, h, w]]),
            "second_per_grid_t": torch.tensor(
                [self.video.temporal_patch_size / clip.fps], dtype=torch.float64
            ),
        }
        return MediaInput(data, t * h * w // self.merge**2)

    def _temporal_step(self, it) -> float:
        if self.tokens_per_second is None:  # Qwen2-VL: one position per temporal patch
            return 1.0
        return float(self.tokens_per_second * it.data["second_per_grid_t"][0])


class Qwen2VLForConditionalGeneration(MRopePositions, VisionLanguageModel):
    mm_adapter = QwenVideoAdapter
    vision_class = "qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel"  # transformers.models.*
    # transformers 5 names first (`model.language_model.`, `model.visual.`), then the older layout whose
    # decoder is the top-level `model.` (so that prefix must come last)
    PREFIXES = (
        (("model.language_model.",), "text"),
        (("model.visual.", "visual."), "visual"),
        (("lm_head.",), "lm_head"),
        (("model.",), "text"),
    )

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.merge = int(config.vision_config.spatial_merge_size)
        self.visual: nn.Module | None = None

    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        tie = bool(getattr(self.config, "tie_word_embeddings", False))
        return MRopeQwen2ForCausalLM(text_config, backend, max_positions, tie_embeddings=tie)

    def build_vision(self, device, dtype) -> None:
        import importlib

        module, name = self.vision_class.split(":")
        cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
        tower = hf_module(lambda: cls._from_config(self.config.vision_config), device, dtype)
        self.visual = use_segment_attention(tower)  # one attention call a layer, not one a window

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One tower pass over all images and videos: attention stays within each image or video frame
        (the grid tells the tower where they end), so batching them changes nothing."""
        w = self.visual.patch_embed.proj.weight
        pixels = torch.cat([it.get("pixel_values", it.get("pixel_values_videos")) for it in items])
        pixels = pixels.to(device=w.device, dtype=w.dtype)
        grid = torch.cat([it.get("image_grid_thw", it.get("video_grid_thw")) for it in items]).to(w.device)
        out = self.visual(pixels, grid_thw=grid)
        feats = getattr(out, "pooler_output", out)  # transformers 5 returns the merged features there
        return list(feats.split((grid.prod(-1) // self.merge**2).tolist()))


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Same decoder and positions; the tower adds window attention (all but `fullatt_block_indexes`)."""

    vision_class = "qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel"
