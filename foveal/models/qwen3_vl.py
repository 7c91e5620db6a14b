"""Qwen3-VL (dense): transformers' vision tower (patch 16, learned position embeddings resampled to each
image's grid, 2-D rotary, patch merger) run once per image, and a native Qwen3 decoder (q/k RMSNorm, no
q/k/v bias) with interleaved M-RoPE: rotary frequencies cycle through the (t, h, w) axes instead of
Qwen2-VL's consecutive sections. Image positions are Qwen2-VL's (`mrope_prompt_positions`).

DeepStack: besides the merged image embeddings, the tower emits one more [num_embeds, hidden] feature
per `vision_config.deepstack_visual_indexes` entry (taken from early vision blocks), and the decoder adds
feature i to the hidden states of the image tokens after its layer i. `encode_images` returns them
concatenated per image, [num_embeds, hidden * (1 + k)], so the vision cache and the per-request
embeddings hold one tensor as for every family; the runner splits the columns (`deepstack_layers`).

Qwen3-VL-MoE: the same tower and positions, with Qwen3-MoE's sparse layers in the decoder (every layer
sparse by default, the top k always renormalized; its published expert stacks are [E, H, 2I] and
[E, I, H]: foveal/models/llama_moe.py).

Videos: each temporal patch stands in the prompt as a timestamp and an image-like run of placeholders
(`Qwen3VLAdapter`); the tower takes the clip's patches in one pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foveal.layers.rotary import MRotaryEmbedding
from foveal.models.base import StepContext
from foveal.models.llama import Qwen3ForCausalLM
from foveal.models.llama_moe import Qwen3Moe
from foveal.models.qwen2_vl import MRope, MRopePositions, Qwen2VLAdapter, mrope_prompt_positions
from foveal.models.qwen_video import QwenVideoConfig, frame_indices, video_patches
from foveal.models.vision_attention import use_segment_attention
from foveal.models.vlm import MediaInput, VisionLanguageModel, hf_module


class MRopeQwen3ForCausalLM(Qwen3ForCausalLM):
    """The Qwen3 decoder with interleaved M-RoPE: `positions` are [3, T] (or [T], the same on all axes).

    transformers 5 keeps `tie_word_embeddings` on the outer VLM config, so it is passed in."""

    def __init__(self, config, backend, max_positions: int, *, tie_embeddings: bool):
        self.tie_embeddings = tie_embeddings  # read by _spec during the base constructor
        super().__init__(config, backend, max_positions)
        self.rotary = self._rotary(max_positions)

    def _spec(self, config):
        spec = super()._spec(config)
        spec.tie_embeddings = self.tie_embeddings
        return spec

    def _rotary(self, max_positions: int) -> MRotaryEmbedding:
        # transformers' Qwen3-VL always interleaves (its config's `mrope_interleaved` is informational)
        return MRotaryEmbedding(self.config, self.spec.head_dim, max_positions, interleaved=True)

    def reset_buffers(self, device, dtype=None) -> None:
        self.rotary = self._rotary(self.rotary.cos.shape[0]).to(device)


class Qwen3VLAdapter(Qwen2VLAdapter):
    """Images as Qwen2-VL's; a video's temporal patches each stand in the prompt as
    `<{t:.1f} seconds><|vision_start|>` + one placeholder per merged cell + `<|vision_end|>` (t: the
    mean time of the patch's frames in the source), and each is positioned like an image of one frame,
    the timestamp text between them advancing like text (transformers' Qwen3VLProcessor and
    get_rope_index)."""

    def __init__(self, hf_config, video_config: dict | None = None):
        super().__init__(hf_config)
        self.video_token_id = int(hf_config.video_token_id)
        self.video_wrapper = (int(hf_config.vision_start_token_id), int(hf_config.vision_end_token_id))
        self.video = QwenVideoConfig.from_dict(video_config, family="qwen3")

    def frame_indices(self, total_frames, video_fps, **sampling):
        return frame_indices(self.video, total_frames, video_fps, **sampling)

    def video_inputs(self, clip, processor) -> MediaInput:
        if not clip.fps > 0:
            raise ValueError(f"a video's frame rate must be positive, got {clip.fps}")
        frames = torch.from_numpy(clip.frames) if not isinstance(clip.frames, torch.Tensor) else clip.frames
        patches, (t, h, w) = video_patches(self.video, frames)
        cells = h * w // self.merge**2
        tok = processor.tokenizer
        start, end, pad = tok.convert_ids_to_tokens([*self.video_wrapper, self.video_token_id])
        text = "".join(
            f"<{s:.1f} seconds>{start}{pad * cells}{end}" for s in self._patch_times(clip, frames.shape[0])
        )
        data = {"pixel_values_videos": patches, "video_grid_thw": torch.tensor([[t, h, w]])}
        return MediaInput(data, t * cells, text)

    def _patch_times(self, clip, n: int) -> list[float]:
        """Each temporal patch's time: the mean of its first and last frame's (the last frame repeats to
        fill the last patch)."""
        times = list(clip.timestamps) if clip.timestamps is not None else [j / clip.fps for j in range(n)]
        tps = self.video.temporal_patch_size
        times += [times[-1]] * (-len(times) % tps)
        return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]

    def rope(self, prompt_ids: list[int], items: list) -> MRope:
        spans = []
        for it in sorted(items, key=lambda it: it.offset):
            if it.modality != "video":
                t, h, w = (int(x) for x in it.data["image_grid_thw"][0])
                spans.append((it.offset, (t, h, w), 1.0))
                continue
            t, h, w = (int(x) for x in it.data["video_grid_thw"][0])
            cells = h * w // self.merge**2
            rows = (
                [it.offset + i for i, e in enumerate(it.embed_index) if e >= 0]
                if it.embed_index is not None
                else [it.offset + i for i in range(it.length)]
            )
            if len(rows) != t * cells:
                raise ValueError(f"video span of {len(rows)} embeddings does not match its grid {t}x{h}x{w}")
            # each temporal patch is positioned as an image of one frame
            spans += [(rows[k * cells], (1, h, w), 1.0) for k in range(t)]
        return mrope_prompt_positions(len(prompt_ids), spans, self.merge)


class Qwen3VLForConditionalGeneration(MRopePositions, VisionLanguageModel):
    # same processor layout (flattened patches + [N, 3] grid) and image positions as Qwen2-VL
    mm_adapter = Qwen3VLAdapter
    # Qwen3-VL was released with transformers' nested layout; transformers maps no older names for it
    PREFIXES = (
        (("model.language_model.",), "text"),
        (("model.visual.",), "visual"),
        (("lm_head.",), "lm_head"),
    )

    def __init__(self, config, backend, max_positions: int):
        super().__init__(config, backend, max_positions)
        vc = config.vision_config
        self.merge = int(vc.spatial_merge_size)
        self.deepstack_layers = len(vc.deepstack_visual_indexes)  # read by the runner
        if self.deepstack_layers > self.language_model.spec.num_layers:
            raise ValueError(
                f"{self.deepstack_layers} DeepStack features but only {self.language_model.spec.num_layers} "
                "decoder layers"
            )
        self.visual: nn.Module | None = None

    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        tie = bool(getattr(self.config, "tie_word_embeddings", False))
        return MRopeQwen3ForCausalLM(text_config, backend, max_positions, tie_embeddings=tie)

    def forward(self, input_ids, ctx: StepContext) -> torch.Tensor:
        """`ctx.deepstack`: the image rows' features of this step, or None (text-only steps, decodes)."""
        return self.language_model(input_ids, ctx)

    def build_vision(self, device, dtype) -> None:
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        tower = hf_module(lambda: Qwen3VLVisionModel._from_config(self.config.vision_config), device, dtype)
        self.visual = use_segment_attention(tower)  # one attention call a layer, not one a frame

    def encode_images(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """One tower pass over all images (attention stays within each image's grid). Per image
        [num_embeds, hidden * (1 + k)]: the merged embeddings, then the k DeepStack features."""
        w = self.visual.patch_embed.proj.weight
        pixels = torch.cat([it.get("pixel_values", it.get("pixel_values_videos")) for it in items])
        pixels = pixels.to(device=w.device, dtype=w.dtype)
        grid = torch.cat([it.get("image_grid_thw", it.get("video_grid_thw")) for it in items]).to(w.device)
        out = self.visual(pixels, grid_thw=grid)
        if isinstance(out, tuple):  # transformers 4.x: (merged, deepstack features)
            merged, deep = out[0], out[1]
        else:  # transformers 5: an output object
            merged, deep = out.pooler_output, out.deepstack_features
        if len(deep) != self.deepstack_layers:
            raise RuntimeError(
                f"the vision tower gave {len(deep)} DeepStack features, not {self.deepstack_layers}"
            )
        feats = torch.cat([merged, *deep], dim=-1)
        return list(feats.split((grid.prod(-1) // self.merge**2).tolist()))


class MRopeQwen3MoeForCausalLM(Qwen3Moe, MRopeQwen3ForCausalLM):
    """Qwen3-VL-MoE's language model: the M-RoPE decoder with mixture-of-experts layers."""

    stacks_transposed = True


class Qwen3VLMoeForConditionalGeneration(Qwen3VLForConditionalGeneration):
    def build_text_model(self, text_config, backend, max_positions: int) -> nn.Module:
        tie = bool(getattr(self.config, "tie_word_embeddings", False))
        return MRopeQwen3MoeForCausalLM(text_config, backend, max_positions, tie_embeddings=tie)

    def build_vision(self, device, dtype) -> None:
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

        vision = self.config.vision_config
        tower = hf_module(lambda: Qwen3VLMoeVisionModel._from_config(vision), device, dtype)
        self.visual = use_segment_attention(tower)  # one attention call a layer, not one a frame
