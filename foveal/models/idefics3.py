"""Idefics3 and SmolVLM: a SigLIP-style vision transformer of variable resolution (transformers' module,
run once per batch of crops), a pixel-shuffle connector with a linear projection (ours) and a native
Llama decoder on the paged KV cache. SmolVLM is the same model under its own config and processor.

Image splitting: the processor cuts each image into a grid of square crops plus one downscaled global
crop, and writes one run of `image_seq_len` <image> tokens per crop, each behind text markers:

    <fake_token_around_image><row_1_col_1><image>*L<fake_token_around_image><row_1_col_2><image>*L\\n ...
    \\n<fake_token_around_image><global-img><image>*L<fake_token_around_image>

so an image's placeholder span interleaves text tokens (the runner's `embed_index` handles that) and its
embeddings are its crops' in processor order, L per crop. One prompt's `pixel_values` are
[1, crops of all its images, 3, H, W]; the adapter groups the crops by image: each image ends with its
global crop, the one whose run follows the <global-img> marker.

Crops that are all zeros are padding (a batch of prompts with different crop counts); transformers drops
them before the encoder and so does the adapter, on the request side, so that an item only holds real
crops and its embedding count is known before encoding.
"""

from __future__ import annotations

import copy
import math
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from num2words import num2words
from torch import nn

from foveal.models.vlm import ImageAdapter, MediaInput, VisionLanguageModel, hf_module

_VIDEO_INTRO = "You are provided the following series of {count} frames from a {duration} [H:MM:SS] video.\n"


def pixel_shuffle(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[n, side*side, d] -> [n, side*side / scale^2, d * scale^2]: each scale x scale block of patches
    becomes one token, with channels in transformers' order (Idefics3Connector.pixel_shuffle)."""
    n, seq, d = x.shape
    side = math.isqrt(seq)
    x = x.reshape(n, side, side // scale, d * scale)  # merge `scale` horizontally adjacent patches
    x = x.permute(0, 2, 1, 3).reshape(n, side // scale, side // scale, d * scale * scale)  # then vertically
    return x.permute(0, 2, 1, 3).reshape(n, seq // (scale * scale), d * scale * scale)


class ModalityProjection(nn.Module):
    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.proj = nn.Linear(in_dim, out_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Idefics3Connector(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.scale_factor = int(config.scale_factor)
        self.modality_projection = ModalityProjection(
            config.vision_config.hidden_size * self.scale_factor**2, config.text_config.hidden_size
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.modality_projection(pixel_shuffle(hidden, self.scale_factor))


def tokens_per_crop(config, height: int, width: int) -> int:
    """Embeddings one crop of height x width pixels gives: patches after the pixel shuffle."""
    patch, scale = config.vision_config.patch_size, int(config.scale_factor)
    rows, cols = height // patch, width // patch
    if rows != cols or rows % scale:
        raise ValueError(
            f"crops of {height}x{width} px make a {rows}x{cols} patch grid; the connector needs a square "
            f"grid whose side divides by scale_factor {scale}"
        )
    return rows * cols // scale**2


class Idefics3Adapter(ImageAdapter):
    # SmolVLM keeps the first crop when all of a batch's crops are padding (transformers' modeling_smolvlm)
    keep_one_padding_crop = False

    def processor_images(self, images: list) -> list:
        return [images]  # the processors take one list of images per prompt

    def split(self, out: dict[str, Any]) -> list[tuple[dict[str, Any], int]]:
        pv = out["pixel_values"]
        mask = out.get("pixel_attention_mask")
        if pv.dim() == 5:  # [prompts=1, crops, 3, H, W]
            pv = pv.reshape(-1, *pv.shape[2:])
            mask = None if mask is None else mask.reshape(-1, *mask.shape[2:])
        # drop padding crops exactly as transformers does: a crop whose pixel values are all 0.0
        real = (pv != 0).flatten(1).any(dim=1)
        if self.keep_one_padding_crop and not bool(real.any()):
            real[0] = True
        pv = pv[real]
        mask = None if mask is None else mask[real]

        per_crop = tokens_per_crop(self.config, pv.shape[-2], pv.shape[-1])
        crops_per_image = self._crops_per_image(out["input_ids"][0].tolist(), per_crop)
        if sum(crops_per_image) != pv.shape[0]:
            raise ValueError(
                f"the prompt has image-token runs for {sum(crops_per_image)} crops but the processor "
                f"gave {pv.shape[0]} crops"
            )
        items, start = [], 0
        for n in crops_per_image:
            data = {"pixel_values": pv[start : start + n].clone()}
            if mask is not None:
                data["pixel_attention_mask"] = mask[start : start + n].clone()
            items.append((data, n * per_crop))
            start += n
        return items

    def _crops_per_image(self, ids: list[int], per_crop: int) -> list[int]:
        """Runs of image tokens are crops, in order; an image's last crop is its global one, the run
        behind the <global-img> marker (the marker of the prompt's last run, which is always global)."""
        tid = self.image_token_id
        runs = []  # (start, end)
        i = 0
        while i < len(ids):
            if ids[i] == tid:
                j = i
                while j < len(ids) and ids[j] == tid:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        if not runs:
            return []
        for a, b in runs:
            if b - a != per_crop:
                raise ValueError(
                    f"an image-token run of {b - a} tokens, but each crop gives {per_crop} embeddings "
                    "(the processor's image_seq_len does not match the model)"
                )
        if runs[0][0] == 0:
            raise ValueError("the prompt starts with an image token: no crop marker before it")
        global_marker = ids[runs[-1][0] - 1]
        counts, n = [], 0
        for a, _ in runs:
            n += 1
            if ids[a - 1] == global_marker:
                counts.append(n)
                n = 0
        return counts


def _pixel_mask(item: dict[str, Any]) -> torch.Tensor:
    """[crops, H, W] bool: which pixels are image, not padding (all of them when the processor gave none)."""
    mask = item.get("pixel_attention_mask")
    if mask is None:
        pv = item["pixel_values"]
        return torch.ones(pv.shape[0], *pv.shape[-2:], dtype=torch.bool)
    return mask.to(torch.bool)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    mm_adapter = Idefics3Adapter
    vision_class = "Idefics3VisionTransformer"
    # transformers 4.x and 5.x save these models under the same names (no conversion mapping lists them)
    PREFIXES = (
        (("model.text_model.",), "text"),
        (("lm_head.",), "lm_head"),
        (("model.vision_model.",), "vision_model"),
        (("model.connector.",), "connector"),
    )

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        self.connector = Idefics3Connector(config)
        self.vision_model: nn.Module | None = None

    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        # transformers ties lm_head to the embeddings by the top-level flag of the VLM config; the text
        # config's own flag is not read
        text_config = copy.deepcopy(text_config)
        text_config.tie_word_embeddings = bool(getattr(self.config, "tie_word_embeddings", False))
        return super().build_text_model(text_config, backend, max_positions)

    def build_vision(self, device, dtype) -> None:
        import transformers

        cls = getattr(transformers, self.vision_class)
        self.vision_model = hf_module(lambda: cls._from_config(self.config.vision_config), device, dtype)

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """Each item: one image's real crops, pixel_values [crops, 3, H, W] (+ pixel_attention_mask
        [crops, H, W]) -> [crops * tokens per crop, hidden]. Items of one crop size share one encoder run."""
        w = self.connector.modality_projection.proj.weight
        out: list[torch.Tensor | None] = [None] * len(items)
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, it in enumerate(items):
            by_size.setdefault(tuple(it["pixel_values"].shape[-2:]), []).append(i)
        for idx in by_size.values():
            pixels = torch.cat([items[i]["pixel_values"] for i in idx])
            masks = torch.cat([_pixel_mask(items[i]) for i in idx])
            feats = self._encode_crops(pixels.to(device=w.device, dtype=w.dtype), masks.to(w.device))
            for i, f in zip(idx, feats.split([items[i]["pixel_values"].shape[0] for i in idx])):
                out[i] = f.reshape(-1, f.shape[-1])
        return out

    def _encode_crops(self, pixels: torch.Tensor, pixel_mask: torch.Tensor) -> torch.Tensor:
        """[n, 3, H, W] crops and their [n, H, W] pixel masks -> [n, tokens per crop, hidden]."""
        patch = self.config.vision_config.patch_size
        # a patch takes part in attention when any of its pixels is real (transformers' get_image_features)
        grid = pixel_mask.unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = grid.sum(dim=(-1, -2)) > 0
        hidden = self.vision_model(
            pixel_values=pixels, patch_attention_mask=patch_mask, return_dict=True
        ).last_hidden_state
        return self.connector(hidden)


class SmolVLMAdapter(Idefics3Adapter):
    """SmolVLM2's video: frames sampled by its rule (fps, at most num_frames, a second skipped at each
    end of a long clip), each resized with Lanczos so its longest edge is the video size, then to the
    square crop size (never split), one crop of `image_seq_len` <image> tokens each; the clip's
    placeholder ("<video>", text the processor replaces, no token) becomes transformers' prompt:

        You are provided the following series of {N in words} frames from a {H:MM:SS} [H:MM:SS] video.\n
        \nFrame from {MM:SS}:<fake_token_around_image><global-img><image>*L<fake_token_around_image> ...\n\n

    (SmolVLMProcessor.replace_video_token; the frames' times are their source times)."""

    keep_one_padding_crop = True
    video_placeholder = "<video>"

    def __init__(self, hf_config, video_config: dict | None = None):
        super().__init__(hf_config, video_config)
        vc = video_config or {}
        sampling = vc.get("video_sampling")  # older checkpoints' block (the video processor reads it first)
        if isinstance(sampling, dict):
            vc = {**vc, "fps": sampling.get("fps"), "num_frames": sampling.get("max_frames")}
            vc["size"] = sampling.get("video_size", vc.get("size"))
        self.video_fps = float(vc.get("fps") or 1.0)
        self.video_num_frames = int(vc.get("num_frames") or 64)
        self.video_longest = min(4096, int((vc.get("size") or {}).get("longest_edge", 4 * 364)))
        self.video_side = int((vc.get("max_image_size") or {}).get("longest_edge", 364))
        self.video_mean = [float(x) for x in vc.get("image_mean", (0.5, 0.5, 0.5))]
        self.video_std = [float(x) for x in vc.get("image_std", (0.5, 0.5, 0.5))]
        self.video_rescale = float(vc.get("rescale_factor", 1 / 255))
        self.video_token_id = self.image_token_id  # the frames' embeddings sit on <image> tokens

    def frame_indices(self, total_frames, video_fps, *, fps=None, num_frames=None, max_frames=None):
        """SmolVLMVideoProcessor.sample_frames: round(fps x duration) frames, at most num_frames, evenly
        spread from index 0 (or a second in, for a clip long enough) to the last (a second short)."""
        if total_frames < 1:
            raise ValueError("the video has no frames")
        cap = min(num_frames or self.video_num_frames, max_frames or self.video_num_frames)
        rate = self.video_fps if fps is None else fps
        duration = total_frames / video_fps if video_fps > 0 else 0.0
        want = max(1, min(int(round(rate * duration)), cap))
        start, end = 0, total_frames - 1
        if duration - 2 > cap * rate:  # skip_secs = 1 at both ends
            start, end = int(video_fps), int(total_frames - video_fps)
        start, end = max(0, start), min(end, total_frames - 1)
        if start >= end:
            start, end = 0, total_frames - 1
        return sorted({int(i) for i in np.linspace(start, end, want, dtype=int)})

    def video_inputs(self, clip, processor) -> MediaInput:
        if not clip.fps > 0:
            raise ValueError(f"a video's frame rate must be positive, got {clip.fps}")
        frames = np.asarray(clip.frames)
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.dtype} {frames.shape}")
        side = self.video_side
        per_crop = tokens_per_crop(self.config, side, side)
        seq_len = getattr(processor, "image_seq_len", None)
        if seq_len is not None and int(seq_len) != per_crop:
            # transformers writes image_seq_len <image> tokens per frame whatever the frame's size
            raise ValueError(
                f"a video frame of {side}x{side} px gives {per_crop} embeddings but the processor's "
                f"image_seq_len is {seq_len} (the video processor's max_image_size does not match the model)"
            )
        pixels = torch.stack([self._frame(f) for f in frames])
        times = clip.timestamps or tuple(j / clip.fps for j in range(len(frames)))
        duration = int(clip.duration) if clip.duration is not None else int(times[-1])
        text = _VIDEO_INTRO.format(count=num2words(len(frames)), duration=str(timedelta(seconds=duration)))
        fake = getattr(processor, "fake_image_token", "<fake_token_around_image>")
        glob = getattr(processor, "global_image_token", "<global-img>")
        image = getattr(processor, "image_token", "<image>")
        crop = f"{fake}{glob}{image * per_crop}{fake}"
        for t in times:
            text += f"\nFrame from {int(t // 60):02d}:{int(t % 60):02d}:" + crop
        data = {
            "pixel_values": pixels,
            "pixel_attention_mask": torch.ones(len(frames), side, side, dtype=torch.bool),
        }
        return MediaInput(data, len(frames) * per_crop, text + "\n\n")

    def _frame(self, frame: np.ndarray) -> torch.Tensor:
        """One uint8 [H, W, 3] frame -> [3, side, side] normalized: Lanczos to the video size's longest
        edge (the other edge by the aspect ratio, rounded up to even), then to the square crop."""
        from PIL import Image

        h, w = frame.shape[:2]
        if w >= h:
            nw, nh = self.video_longest, int(self.video_longest / (w / h))
            nh += nh % 2
        else:
            nh, nw = self.video_longest, int(self.video_longest * (w / h))
            nw += nw % 2
        im = Image.fromarray(frame).resize((max(nw, 1), max(nh, 1)), Image.Resampling.LANCZOS)
        im = im.resize((self.video_side, self.video_side), Image.Resampling.LANCZOS)
        x = torch.from_numpy(np.asarray(im, dtype=np.float32)).permute(2, 0, 1) * self.video_rescale
        mean = torch.tensor(self.video_mean).view(3, 1, 1)
        return (x - mean) / torch.tensor(self.video_std).view(3, 1, 1)


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    mm_adapter = SmolVLMAdapter
    vision_class = "SmolVLMVisionTransformer"
