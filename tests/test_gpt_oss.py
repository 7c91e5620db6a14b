"""gpt-oss beyond the logits parity of test_model_parity.py: MXFP4 expert tensors as the published
checkpoints store them, YaRN against transformers' own frequencies, and the engine (recorded CPU
decode steps included: the native kernel's sinks) against transformers' generate."""

from __future__ import annotations

import pytest
import torch

from foveal.models.gpt_oss import dequantize_mxfp4
from tests.tiny import tiny_config, tiny_hf_model


def test_mxfp4_dequantizes_as_transformers_does():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 10, 4), generator=g, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, rows, cols]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, cols, rows]
    assert ours.shape == (3, 10, 128) and torch.equal(ours, theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_yarn_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from foveal.layers.rotary import attention_factor, inv_frequencies

    cfg = tiny_config("gpt_oss")
    want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    torch.testing.assert_close(inv_frequencies(cfg, cfg.head_dim), want, rtol=1e-6, atol=0)
    assert attention_factor(cfg) == pytest.approx(factor)


def _published(hf, seed: int = 1) -> tuple[dict, dict]:
    """(state dict for transformers, the same model as a published checkpoint): expert stacks drawn as
    MXFP4 codes and scales, stored as blocks/scales; transformers gets their dequantized values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    state, published = dict(hf.state_dict()), {}
    for name, t in hf.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            published[name] = t
            continue
        E, cols, rows = t.shape  # transformers' [E, cols, rows]
        blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 128, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
        state[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        published[name + "_blocks"], published[name + "_scales"] = blocks, scales
    return state, published


def test_the_published_mxfp4_layout_loads_to_transformers_weights():
    from foveal.attention import get_backend
    from foveal.models import build_model

    hf = tiny_hf_model("gpt_oss")
    state, published = _published(hf)
    hf.load_state_dict(state)

    def build(weights):
        backend = get_backend("torch", "cpu")
        return build_model(hf.config, backend, max_positions=64, dtype=torch.float32, device="cpu",
                           weights=weights)  # fmt: skip

    a, b = build(iter(state.items())), build(iter(published.items()))
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    lone = {n: t for n, t in published.items() if not n.endswith("layers.1.mlp.experts.down_proj_scales")}
    with pytest.raises(ValueError, match="without their pair"):
        build(iter(lone.items()))


def test_the_engine_generates_as_transformers(tmp_path):
    """Greedy tokens of three prompts batched (windows and sinks in every decode step: the recorded CPU
    steps use the native kernel) equal transformers' generate."""
    from foveal import SamplingParams
    from foveal.engine.llm import LLM
    from tests.tiny_vlm import byte_tokenizer

    tok = byte_tokenizer([], "")
    hf = tiny_hf_model("gpt_oss", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 12, 25)]
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, num_blocks=128)
    assert llm.engine.runner.graphs is not None  # recorded decode steps (the native kernel's sinks)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        assert out.outputs[0].token_ids == want[0, len(ids) :].tolist()
