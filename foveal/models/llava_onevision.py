"""LLaVA-OneVision: a SigLIP tower (transformers' module), LLaVA's two-layer projector, a learned
newline embedding and a native Qwen2 decoder on the paged KV cache.

Images ("anyres"): the processor pads and cuts an image into a grid of tower-sized tiles (the grid
from `image_grid_pinpoints` that best fits it) and adds one base tile of the whole image resized. Every
tile is encoded (P x P features, P = image_size / patch_size) and projected; then

    base tile's P*P features | the grid's features as one (rows*P) x (cols*P) map, the rows and columns
    the processor padded in cut off (unpad), shrunk bilinearly when it holds more than
    max_num_patches * P*P (vision_aspect_ratio "anyres_max_N", by a ratio over 1.1), the newline
    embedding after each of its rows

Video: every frame resized to the tower's size (transformers' video processor: bicubic, uint8, then
rescale and normalize), encoded and projected, each frame's P x P features pooled bilinearly to
ceil(P/2) x ceil(P/2); all frames in order, then one newline embedding. Frames are sampled uniformly
(`num_frames` or `fps` a request asks; else the checkpoint's video settings, else 32 frames).

A prompt's images are given to the processor as one flat list, so each is tiled as above (the
processor's multi-image form, one base tile per image, is what transformers does for nested lists).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from foveal.models.llava import projector_for, tower_features
from foveal.models.vlm import (
    LLAVA_STYLE_PREFIXES,
    ImageAdapter,
    MediaInput,
    VisionLanguageModel,
    hf_module,
    uniform_frames,
)
from foveal.models.weights import ParamFiller

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' OPENAI_CLIP_MEAN / STD (the video defaults)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_VIDEO_FRAMES = 32


def best_resolution(height: int, width: int, pinpoints) -> tuple[int, int]:
    """transformers' select_best_resolution: the (h, w) of `pinpoints` keeping the most of the image's
    pixels once it is fit inside (aspect kept), then wasting the least."""
    from transformers.image_processing_utils import select_best_resolution

    return tuple(int(x) for x in select_best_resolution((height, width), [list(p) for p in pinpoints]))


def packed_shape(height: int, width: int, rows: int, cols: int, per_side: int, max_patches: int):
    """(feature rows, feature columns) of an image of `height` x `width` whose grid is rows x cols tiles
    of per_side x per_side features: after unpadding, then the anyres_max shrink."""
    cur_h, cur_w = per_side * rows, per_side * cols
    if width / height > cur_w / cur_h:  # padded above and below
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    ratio = math.sqrt(cur_h * cur_w / (max_patches * per_side**2))
    if ratio > 1.1:
        return int(cur_h // ratio), int(cur_w // ratio), (cur_h, cur_w)
    return cur_h, cur_w, (cur_h, cur_w)


class LlavaOnevisionAdapter(ImageAdapter):
    def __init__(self, hf_config, video_config: dict | None = None):
        super().__init__(hf_config, video_config)
        if getattr(hf_config, "vision_feature_select_strategy", "full") != "full":
            raise ValueError(
                "LLaVA-OneVision with vision_feature_select_strategy "
                f"{hf_config.vision_feature_select_strategy!r} is not supported (published ones use 'full')"
            )
        vc = hf_config.vision_config
        self.tile = int(vc.image_size)
        self.per_side = self.tile // int(vc.patch_size)
        self.pinpoints = hf_config.image_grid_pinpoints
        aspect = str(getattr(hf_config, "vision_aspect_ratio", "anyres_max_9"))
        self.max_patches = int(aspect.removeprefix("anyres_max_"))
        vid = getattr(hf_config, "video_token_id", None)
        vid = getattr(hf_config, "video_token_index", None) if vid is None else vid
        self.video_token_id = None if vid is None else int(vid)
        v = video_config or {}
        size = v.get("size") or {}
        self.video_size = (int(size.get("height", self.tile)), int(size.get("width", self.tile)))
        self.video_mean = [float(x) for x in v.get("image_mean") or _CLIP_MEAN]
        self.video_std = [float(x) for x in v.get("image_std") or _CLIP_STD]
        self.video_rescale = float(v.get("rescale_factor") or 1 / 255)
        self.video_frames = int(v.get("num_frames") or DEFAULT_VIDEO_FRAMES)
        self.video_fps = v.get("fps")

    # -- images ---------------------------------------------------------------------------------------
    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The image's grid of tiles (rows, cols)."""
        h, w = best_resolution(height, width, self.pinpoints)
        return h // self.tile, w // self.tile

    def num_embeds(self, height: int, width: int) -> int:
        rows, cols = self.grid(height, width)
        h, w, _ = packed_shape(height, width, rows, cols, self.per_side, self.max_patches)
        return self.per_side**2 + h * (w + 1)

    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        pv, sizes = out["pixel_values"], out["image_sizes"]
        items = []
        for i in range(pv.shape[0]):
            h, w = (int(x) for x in sizes[i])
            rows, cols = self.grid(h, w)
            data = {"pixel_values": pv[i, : rows * cols + 1], "image_size": torch.tensor([h, w])}
            items.append((data, self.num_embeds(h, w)))
        return items

    # -- video ----------------------------------------------------------------------------------------
    def frame_indices(self, total_frames, video_fps, *, fps=None, num_frames=None, max_frames=None):
        """Uniform: `num_frames` frames, or `fps` frames a second (transformers' default sampler: frame
        i of n is i * total // n), else the checkpoint's number (or rate), capped by max_frames."""
        if total_frames < 1:
            raise ValueError("the video has no frames")
        if num_frames is None and fps is None:
            fps, num_frames = (float(self.video_fps), None) if self.video_fps else (None, self.video_frames)
        cap = max_frames or total_frames
        return uniform_frames(total_frames, video_fps, fps=fps, num_frames=num_frames, max_frames=cap)

    def video_inputs(self, clip, processor) -> MediaInput:
        from foveal.models.qwen_video import resize_uint8

        frames = np.asarray(clip.frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
        x = torch.from_numpy(frames).permute(0, 3, 1, 2)
        h, w = self.video_size
        if (x.shape[-2], x.shape[-1]) != (h, w):
            x = resize_uint8(x, h, w)
        mean = torch.tensor(self.video_mean).view(1, 3, 1, 1)
        std = torch.tensor(self.video_std).view(1, 3, 1, 1)
        pixels = (x.float() * self.video_rescale - mean) / std
        pooled = -(-self.per_side // 2)
        return MediaInput({"pixel_values_videos": pixels}, len(frames) * pooled * pooled + 1)


class LlavaOnevisionForConditionalGeneration(VisionLanguageModel):
    mm_adapter = LlavaOnevisionAdapter
    PREFIXES = LLAVA_STYLE_PREFIXES

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.multi_modal_projector = projector_for(config)
        self.image_newline = nn.Parameter(torch.zeros(config.text_config.hidden_size))
        self.vision_tower: nn.Module | None = None
        self.shapes = LlavaOnevisionAdapter(config)  # the grid and packing rules, shared with the requests

    def build_vision(self, device, dtype) -> None:
        from transformers import AutoModel

        self.vision_tower = hf_module(lambda: AutoModel.from_config(self.config.vision_config), device, dtype)

    def load_weight(self, filler: ParamFiller, name: str, tensor: torch.Tensor, own: dict | None = None):
        if name in ("image_newline", "model.image_newline"):  # a bare parameter, no module prefix
            filler.put("image_newline", tensor, name)
            return
        super().load_weight(filler, name, tensor, own)

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Images and clips of any requests: all their tiles and frames through the tower in one call."""
        tiles = [it["pixel_values"] if "pixel_values" in it else it["pixel_values_videos"] for it in items]
        feats = tower_features(self, torch.cat(tiles)).split([len(t) for t in tiles])
        return [
            self._pack(f, it["image_size"]) if "pixel_values" in it else self._pool(f)
            for f, it in zip(feats, items)
        ]

    def _pack(self, feats: torch.Tensor, image_size: torch.Tensor) -> torch.Tensor:
        """An image's tiles' features [1 + rows*cols, P*P, D] -> its embeddings (the module docstring)."""
        P, s = self.shapes.per_side, self.shapes
        height, width = (int(x) for x in image_size)
        rows, cols = s.grid(height, width)
        base, grid = feats[0], feats[1:]
        x = grid.view(rows, cols, P, P, -1).permute(4, 0, 2, 1, 3).reshape(-1, rows * P, cols * P)
        h, w, (uh, uw) = packed_shape(height, width, rows, cols, P, s.max_patches)
        top, left = (rows * P - uh) // 2, (cols * P - uw) // 2
        x = x[:, top : top + uh, left : left + uw]  # unpad
        if (h, w) != (uh, uw):
            x = F.interpolate(x[None], [h, w], mode="bilinear")[0]
        newline = self.image_newline.to(x.dtype)[:, None, None].expand(-1, h, 1)
        x = torch.cat([x, newline], dim=-1).flatten(1, 2).transpose(0, 1)
        return torch.cat([base, x])

    def _pool(self, feats: torch.Tensor) -> torch.Tensor:
        """A clip's frames' features [T, P*P, D] -> [T * ceil(P/2)^2 + 1, D]."""
        P = self.shapes.per_side
        x = feats.view(feats.shape[0], P, P, -1).permute(0, 3, 1, 2)
        x = F.interpolate(x, size=[-(-P // 2), -(-P // 2)], mode="bilinear")
        x = x.permute(0, 2, 3, 1).reshape(-1, feats.shape[-1])
        return torch.cat([x, self.image_newline.to(x.dtype)[None]])
