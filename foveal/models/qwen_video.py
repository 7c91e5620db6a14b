"""Video inputs of the Qwen-VL families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): which frames of a clip to
decode, and the sampled frames -> the vision tower's flattened patches, as transformers'
`Qwen2VLVideoProcessor` / `Qwen3VLVideoProcessor` make them (their rules, written here with torch alone:
transformers' video processors need torchvision, which a CPU-only install lacks;
tests/test_video_inputs.py checks both against it where it loads). Qwen3-VL samples with a rounded
linspace and sizes frames by a pixel budget for the whole clip; Qwen2-VL by a budget per frame.

    frames [T, H, W, 3] uint8 -> resize every frame to (h, w): multiples of patch * merge, the pixels
    within [shortest_edge, a per-frame share of the clip's budget] (qwen-vl-utils' cap) -> rescale and
    normalize -> pad T to a multiple of temporal_patch_size with the last frame -> patches
    [t * h' * w', 3 * temporal_patch_size * patch^2] in the tower's merge order, grid (t, h', w').

Request-side only (the server's input pool): no weights, no device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# transformers' Qwen2VLVideoProcessor defaults (a checkpoint's video_preprocessor_config.json overrides)
_DEFAULTS = {
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_frames": 4,
    "max_frames": 768,
    "fps": 2.0,
    "max_video_tokens": 128000,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "rescale_factor": 1 / 255,
}


_QWEN3 = {
    **_DEFAULTS,
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "patch_size": 16,
    "max_video_tokens": 768,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w): each a multiple of `factor`, the area within [min_pixels, max_pixels], the aspect kept as
    closely as that allows (Qwen2-VL's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video frame's aspect ratio must be under 200, got {width}x{height}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_clip(
    frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's rule: (h, w) multiples of `factor` whose pixels over the whole clip (frames rounded to
    the temporal patch) stay within [min_pixels, max_pixels]."""
    if frames < temporal:
        raise ValueError(f"a video needs at least {temporal} frames here, got {frames}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video frame's aspect ratio must be under 200, got {width}x{height}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True, slots=True)
class QwenVideoConfig:
    family: str  # "qwen2" (Qwen2-VL, Qwen2.5-VL) or "qwen3"
    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    fps: float
    max_video_tokens: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float

    @classmethod
    def from_dict(cls, d: dict | None, family: str = "qwen2") -> QwenVideoConfig:
        """From a video_preprocessor_config.json's values (transformers' defaults for what it omits)."""
        c = {
            **(_QWEN3 if family == "qwen3" else _DEFAULTS),
            **{k: v for k, v in (d or {}).items() if v is not None},
        }
        size = dict(c["size"])
        if "min_pixels" in c:
            size["shortest_edge"] = c["min_pixels"]
        if "max_pixels" in c:
            size["longest_edge"] = c["max_pixels"]
        return cls(
            family=family,
            min_pixels=int(size["shortest_edge"]),
            max_pixels=int(size["longest_edge"]),
            patch_size=int(c["patch_size"]),
            temporal_patch_size=int(c["temporal_patch_size"]),
            merge_size=int(c["merge_size"]),
            min_frames=int(c["min_frames"]),
            max_frames=int(c["max_frames"]),
            fps=float(c["fps"]),
            max_video_tokens=int(c["max_video_tokens"]),
            mean=tuple(float(x) for x in c["image_mean"]),
            std=tuple(float(x) for x in c["image_std"]),
            rescale=float(c["rescale_factor"]),
        )


def frame_indices(
    cfg: QwenVideoConfig,
    total_frames: int,
    video_fps: float,
    *,
    fps: float | None = None,
    num_frames: int | None = None,
    max_frames: int | None = None,
) -> list[int]:
    """The frames to decode: `num_frames` (rounded to the temporal patch), or `fps` per second of the
    clip (the config's by default), within [min_frames, max_frames] and the clip's own frames, a
    multiple of the temporal patch; evenly spread (transformers' Qwen2VLVideoProcessor.sample_frames)."""
    tps = cfg.temporal_patch_size
    cap = min(cfg.max_frames, max_frames or cfg.max_frames)
    if total_frames < 1:
        raise ValueError("the video has no frames")
    if cfg.family == "qwen3":  # Qwen3VLVideoProcessor.sample_frames: a rounded linspace, no patch rounding
        if num_frames is None:
            n = int(total_frames / video_fps * (cfg.fps if fps is None else fps))
            n = min(max(n, cfg.min_frames), cap, total_frames)
        else:
            n = min(num_frames, cap, total_frames)
        return sorted({int(round(x)) for x in np.linspace(0, total_frames - 1, max(n, 1))})
    if num_frames is not None:
        n = round(num_frames / tps) * tps
    else:
        rate = cfg.fps if fps is None else fps
        top = math.floor(min(cap, total_frames) / tps) * tps
        n = total_frames / video_fps * rate
        n = math.floor(min(max(n, cfg.min_frames), top, total_frames) / tps) * tps
    n = min(n, math.floor(cap / tps) * tps)
    if n < 1:  # a clip shorter than one temporal patch: every frame (patchify pads with the last)
        return list(range(min(total_frames, cap)))
    if n > total_frames:
        raise ValueError(f"cannot sample {n} frames from a video of {total_frames}")
    # as transformers computes them (a float32 arange, truncated), so the same frames are taken; its
    # float steps can yield one index too many, which is dropped here
    return torch.arange(0, total_frames, total_frames / n).int().tolist()[:n]


def resize_uint8(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """uint8 [N, 3, H, W] -> [N, 3, h, w], bicubic with antialiasing as torchvision resizes uint8 frames
    (transformers' video processors, qwen-vl-utils): torch's uint8 kernel on the CPU, which rounds and
    clamps between its horizontal and vertical passes (one float pass differs by up to ~20 levels where
    bicubic overshoots); elsewhere the two passes in float, each rounded and clamped (within 2 levels of
    the kernel, whose weights are fixed-point)."""
    if x.device.type == "cpu":
        return F.interpolate(x.contiguous(), size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    return resize_two_pass(x, h, w)


def resize_two_pass(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """resize_uint8 in float: the horizontal pass, then the vertical, each rounded and clamped."""
    y = x.float()
    for size in ((x.shape[2], w), (h, w)):
        y = F.interpolate(y, size=size, mode="bicubic", antialias=True, align_corners=False)
        y = y.round_().clamp_(0, 255)
    return y.to(torch.uint8)


def video_patches(cfg: QwenVideoConfig, frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 frames [T, H, W, 3] -> (patches [t*h*w, 3 * temporal * patch^2] float32, grid (t, h, w))."""
    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    T, H, W, _ = frames.shape
    p, m, tps = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    factor = p * m
    if cfg.family == "qwen3":  # a pixel budget for the whole clip
        h, w = smart_resize_clip(T, H, W, tps, factor, cfg.min_pixels, cfg.max_pixels)
    else:  # the clip's pixel budget shared by its frames, floored a little above the smallest frame
        total = int(cfg.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(cfg.max_pixels, total * tps // T), int(cfg.min_pixels * 1.05))
        h, w = smart_resize(H, W, factor, cfg.min_pixels, max_pixels)
    x = frames.permute(0, 3, 1, 2)
    if (h, w) != (H, W):
        x = resize_uint8(x, h, w)
    x = x.float()
    mean = torch.tensor(cfg.mean).view(1, 3, 1, 1) / cfg.rescale
    std = torch.tensor(cfg.std).view(1, 3, 1, 1) / cfg.rescale
    x = (x - mean) / std
    if pad := -T % tps:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    t, gh, gw = x.shape[0] // tps, h // p, w // p
    x = x.view(t, tps, 3, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * gh * gw, 3 * tps * p * p), (t, gh, gw)
