"""Native models vs transformers on tiny random configs: prefill logits (every position), 20 decode
steps through the paged cache, batched sequences of different lengths, and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from foveal.request import FinishReason
from tests.tiny import Harness, tiny_hf_model

FAMILIES = [
    "llama", "llama3", "mistral", "qwen2", "qwen3", "gemma3", "gemma3_softcap",
    "qwen3_moe", "qwen3_moe_unnormed", "mixtral", "gpt_oss",
]  # fmt: skip
TOL = 1e-4


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(family):
    hf = tiny_hf_model(family)
    h = Harness(hf)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 13, 30)]
    reqs = [h.add(f"r{i}", p) for i, p in enumerate(prompts)]

    batch = h.sched.schedule()
    assert len(batch.items) == 3 and batch.num_tokens == 48
    ours = h.runner.compute_logits(batch, all_tokens=True)
    off = 0
    for s in batch.items:
        ref = hf_logits(hf, s.token_ids)
        assert (ours[off : off + s.num_tokens] - ref).abs().max().item() < TOL
        off += s.num_tokens
    sampled = {s.request_id: [int(ours[off_end - 1].argmax())] for s, off_end in _ends(batch)}
    h.sched.update(batch, sampled)

    for _ in range(20):
        batch = h.sched.schedule()
        assert all(s.num_tokens == 1 for s in batch.items)
        ours = h.runner.compute_logits(batch)
        sampled = {}
        for row, s in enumerate(batch.items):
            ref = hf_logits(hf, h.sched.get(s.request_id).all_token_ids)[-1]
            assert (ours[row] - ref).abs().max().item() < TOL, f"{family} decode step mismatch"
            sampled[s.request_id] = [int(ref.argmax())]
        h.sched.update(batch, sampled)
    for r in reqs:
        h.sched.finish(r, FinishReason.ABORT)
    h.kv.check_integrity()
    assert h.kv.num_used_blocks == 0


def _ends(batch):
    off = 0
    for s in batch.items:
        off += s.num_tokens
        yield s, off


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_matches_unchunked(family, budget):
    """A 40-token prompt split into chunks of `budget` tokens (with a decoding request sharing the steps)
    gives the same per-position logits as transformers on the whole prompt."""
    hf = tiny_hf_model(family)
    h = Harness(hf, budget=budget + 1)
    g = torch.Generator().manual_seed(2)
    short = torch.randint(0, 256, (3,), generator=g).tolist()
    long = torch.randint(0, 256, (40,), generator=g).tolist()
    h.add("short", short, max_tokens=64)
    h.add("long", long)
    ref_long = hf_logits(hf, long)
    got = {}
    steps = 0
    while "long" not in got or len(got["long"]) < 40:
        batch = h.sched.schedule()
        logits = h.runner.compute_logits(batch, all_tokens=True)
        sampled = {}
        for s, end in _ends(batch):
            rows = logits[end - s.num_tokens : end]
            if s.request_id == "long":
                got.setdefault("long", []).extend(rows)
            if s.num_logits:
                sampled[s.request_id] = [int(rows[-1].argmax())]
        h.sched.update(batch, sampled)
        steps += 1
        assert steps < 200
    assert steps > 1
    ours = torch.stack(got["long"][:40])
    assert (ours - ref_long).abs().max().item() < TOL
    h.kv.check_integrity()


def test_unknown_architecture_names_supported_ones():
    import transformers as tf

    from foveal.models import model_class

    cfg = tf.GPT2Config()
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        model_class(cfg)
