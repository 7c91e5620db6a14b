"""The Qwen-VL vision towers with every segment of a layer in one attention call
(foveal/models/vision_attention.py) against the same towers on transformers' per-segment path: images
and a clip in one pass, windows cut unevenly at a grid's edge (Qwen2.5-VL), DeepStack features
(Qwen3-VL); the model's own config keeps its attention implementation."""

from __future__ import annotations

import pytest
import torch

from foveal.models import vision_attention
from foveal.models.vision_attention import use_segment_attention


def _qwen2_vl():
    import transformers as tf
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    vision = dict(depth=2, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  embed_dim=32, hidden_size=64, mlp_ratio=2)  # fmt: skip
    return Qwen2VisionTransformerPretrainedModel, tf.Qwen2VLConfig(vision_config=vision).vision_config, 14


def _qwen2_5_vl():
    import transformers as tf
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    vision = dict(depth=4, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                  fullatt_block_indexes=[1, 3])  # fmt: skip
    cfg = tf.Qwen2_5_VLConfig(vision_config=vision).vision_config
    return Qwen2_5_VisionTransformerPretrainedModel, cfg, 14


def _qwen3_vl():
    import transformers as tf
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])  # fmt: skip
    return Qwen3VLVisionModel, tf.Qwen3VLConfig(vision_config=vision).vision_config, 16


@pytest.mark.parametrize(
    "family", [_qwen2_vl, _qwen2_5_vl, _qwen3_vl], ids=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
)
def test_one_call_a_layer_equals_the_per_segment_path(family, monkeypatch):
    cls, config, patch = family()
    torch.manual_seed(0)
    ref = cls._from_config(config).eval()
    mine = cls._from_config(config).eval()
    mine.load_state_dict(ref.state_dict())
    use_segment_attention(mine)
    assert config._attn_implementation == ref.config._attn_implementation != vision_attention.NAME
    sdpa_calls = []
    real_sdpa = vision_attention.F.scaled_dot_product_attention

    def counting(*a, **k):
        sdpa_calls.append(a[0].shape[0])  # segments in the batch
        return real_sdpa(*a, **k)

    monkeypatch.setattr(vision_attention.F, "scaled_dot_product_attention", counting)
    # an image whose windows are cut unevenly (10 x 14 patches), a 2-group clip, a small image; then a
    # large image beside small ones (several padded batches: the small ones are not padded to its size)
    for grid in ([[1, 10, 14], [2, 12, 8], [1, 4, 4]], [[1, 32, 32], [1, 4, 4], [1, 4, 4], [2, 4, 8]]):
        grid = torch.tensor(grid)
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * patch * patch)
        with torch.no_grad():
            sdpa_calls.clear()
            want = ref(pixels, grid_thw=grid)
            per_segment = len(sdpa_calls)
            sdpa_calls.clear()
            got = mine(pixels, grid_thw=grid)
        assert len(mine.blocks) <= len(sdpa_calls) < per_segment  # a batch of segments a call
        torch.testing.assert_close(got.pooler_output, want.pooler_output, rtol=1e-5, atol=1e-5)
        deep = getattr(got, "deepstack_features", None) or []
        for a, b in zip(deep, getattr(want, "deepstack_features", None) or []):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(sdpa_calls) > len(mine.blocks)  # the last grid needed more than one batch in some layer


def test_batches_keep_padding_bounded():
    """A 1,024-row segment beside 16-row ones: the small ones share a batch of their own."""
    from foveal.models.vision_attention import _buckets

    cu = (0, 16, 1040, 1056, 1072)
    got = [(G, L) for _, _, G, L, _ in _buckets(cu, "cpu")]
    assert got == [(2, 1024), (2, 16)]
    assert [(G, L) for _, _, G, L, _ in _buckets((0, 8, 16, 24), "cpu")] == [(3, 8)]
    assert _buckets((0, 8, 16, 24), "cpu")[0][0] is None  # equal segments in order: no gather


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", [_qwen2_5_vl, _qwen3_vl], ids=["qwen2_5_vl", "qwen3_vl"])
def test_on_cuda_in_bf16(family):
    """As served: bf16 on the GPU, the padded batches' masked attention against the per-segment path."""
    cls, config, patch = family()
    torch.manual_seed(0)
    ref = cls._from_config(config).eval()
    mine = cls._from_config(config).eval()
    mine.load_state_dict(ref.state_dict())
    ref, mine = ref.to("cuda", torch.bfloat16), use_segment_attention(mine.to("cuda", torch.bfloat16))
    grid = torch.tensor([[1, 32, 32], [1, 4, 4], [2, 12, 8], [1, 10, 14]], device="cuda")
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * patch * patch, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want, got = ref(pixels, grid_thw=grid).pooler_output, mine(pixels, grid_thw=grid).pooler_output
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
