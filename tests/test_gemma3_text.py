"""Gemma 3 text decoder (Gemma3ForCausalLM) vs transformers on a tiny random config (fp32, CPU), with a
sliding window of 8 so that prompts of 13-40 tokens and 20 decode steps cross it on the local layers:
prefill logits at every position, decode steps through the paged cache, chunked prefill (chunks that
start past the window), and the logit softcap and untied-head switches. (Hub-style checkpoint names of
the Gemma 3 VLM are tested in test_vlm_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from foveal.models import max_context
from foveal.request import FinishReason
from tests.tiny import Harness

TOL = 1e-4
WINDOW = 8


def tiny_gemma3(seed: int = 0, **overrides):
    import transformers as tf

    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=24,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    cfg = tf.Gemma3TextConfig(**kw)
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    # random init leaves the (1 + w) norms at w = 0: perturb them so the norm weights are tested too
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    cfg.architectures = [type(model).__name__]
    return model


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _ends(batch):
    off = 0
    for s in batch.seqs:
        off += s.num_tokens
        yield s, off


@pytest.mark.parametrize(
    "overrides",
    [{}, {"final_logit_softcapping": 3.0, "tie_word_embeddings": False}],
    ids=["default", "softcap_untied"],
)
def test_prefill_and_decode_match_transformers(overrides):
    hf = tiny_gemma3(**overrides)
    h = Harness(hf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 13, 30)]
    reqs = [h.add(f"r{i}", p) for i, p in enumerate(prompts)]

    batch = h.sched.schedule()
    assert len(batch.seqs) == 3 and batch.num_tokens == 48
    ours = h.runner.compute_logits(batch, all_tokens=True)
    for s, end in _ends(batch):
        ref = hf_logits(hf, s.token_ids)
        assert (ours[end - s.num_tokens : end] - ref).abs().max().item() < TOL
    h.sched.update(batch, {s.request.request_id: int(ours[end - 1].argmax()) for s, end in _ends(batch)})

    for _ in range(20):
        batch = h.sched.schedule()
        assert all(s.num_tokens == 1 for s in batch.seqs)
        ours = h.runner.compute_logits(batch)
        sampled = {}
        for row, s in enumerate(batch.seqs):
            ref = hf_logits(hf, s.request.all_token_ids)[-1]
            assert (ours[row] - ref).abs().max().item() < TOL, "decode step mismatch"
            sampled[s.request.request_id] = int(ref.argmax())
        h.sched.update(batch, sampled)
    for r in reqs:
        h.sched.finish(r, FinishReason.ABORT)
    h.kv.check_integrity()
    assert h.kv.num_used_blocks == 0


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_chunked_prefill_matches_unchunked(budget):
    """A 40-token prompt in chunks of `budget` tokens (a decoding request sharing the steps) gives the
    per-position logits transformers gives for the whole prompt."""
    hf = tiny_gemma3()
    h = Harness(hf, budget=budget + 1)
    g = torch.Generator().manual_seed(2)
    short = torch.randint(3, 256, (3,), generator=g).tolist()
    long = torch.randint(3, 256, (40,), generator=g).tolist()
    h.add("short", short, max_tokens=64)
    h.add("long", long)
    ref_long = hf_logits(hf, long)
    got: list[torch.Tensor] = []
    steps = 0
    while len(got) < 40:
        batch = h.sched.schedule()
        logits = h.runner.compute_logits(batch, all_tokens=True)
        sampled = {}
        for s, end in _ends(batch):
            rows = logits[end - s.num_tokens : end]
            if s.request.request_id == "long":
                got.extend(rows)
            if s.sample:
                sampled[s.request.request_id] = int(rows[-1].argmax())
        h.sched.update(batch, sampled)
        steps += 1
        assert steps < 200
    assert steps > 1
    assert (torch.stack(got[:40]) - ref_long).abs().max().item() < TOL
    h.kv.check_integrity()


def test_context_is_not_capped_to_the_window():
    import transformers as tf

    hf = tiny_gemma3()
    assert max_context(hf.config) == 512
    mistral = tf.MistralConfig(sliding_window=64, max_position_embeddings=512)
    mistral.architectures = ["MistralForCausalLM"]
    assert max_context(mistral) == 64
