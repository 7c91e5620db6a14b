"""The segment-batched vision attention (foveal/models/vision_attention.py) against transformers' own
towers, fp32 CPU: Qwen2-VL (whole-image segments), Qwen2.5-VL (8x8-patch windows, edge windows of
other lengths, full-attention layers) and Qwen3-VL, several images of different sizes in one pass."""

from __future__ import annotations

import copy

import pytest
import torch

from foveal.models.vision_attention import patch_vision_attention, plan_segments, segment_attention


def _towers(family: str):
    if family == "qwen2_vl":
        from transformers import Qwen2VLConfig
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as T

        cfg = Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14)
        ).vision_config
    elif family == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as T,
        )

        cfg = Qwen2_5_VLConfig(
            vision_config=dict(
                depth=3,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=14,
                window_size=112,
                fullatt_block_indexes=[1],
            )  # fmt: skip
        ).vision_config
    else:
        from transformers import Qwen3VLConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as T

        cfg = Qwen3VLConfig(
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=16,
                num_position_embeddings=64,
                deepstack_visual_indexes=[0],
            )  # fmt: skip
        ).vision_config
    torch.manual_seed(0)
    ref = T._from_config(cfg).eval()
    ours = copy.deepcopy(ref)
    assert patch_vision_attention(ours) == cfg.depth
    return cfg, ref, ours


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_patched_tower_equals_transformers(family):
    cfg, ref, ours = _towers(family)
    p, t, m = cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size
    # grids in patches (t, h, w): 20x24 patches = several 8x8 windows plus ragged edge windows
    grid = torch.tensor([[1, 20, 24], [1, 8, 8], [1, 4, 12]])
    n = int(grid.prod(-1).sum())
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(n, 3 * t * p * p, generator=g)
    with torch.no_grad():
        a, b = ref(pixels, grid_thw=grid), ours(pixels, grid_thw=grid)
        a2 = ours(pixels, grid_thw=grid)  # a second pass re-plans (new cu_seqlens tensors)
    fa, fb, fb2 = (getattr(x, "pooler_output", x) for x in (a, b, a2))
    assert fa.shape == (n // m**2, fa.shape[-1])
    assert (fa - fb).abs().max().item() < 1e-5
    assert torch.equal(fb, fb2)


def test_segment_attention_groups_equal_lengths():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(23, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 8, 15, 19, 23])  # lengths 4, 4, 7, 4, 4
    plan = plan_segments(cu)
    assert sorted((length, r.shape[0]) for length, r in plan) == [(4, 4), (7, 1)]
    out = segment_attention(q, k, v, plan, 0.3)
    for lo, hi in zip(cu.tolist(), cu.tolist()[1:]):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1), scale=0.3
        ).transpose(0, 1)
        assert torch.allclose(out[lo:hi], ref, atol=1e-6)
