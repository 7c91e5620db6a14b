"""Gemma 3 text (Gemma3ForCausalLM): its parity with transformers (a window of 8 crossed by the prompts
and 20 decode steps, chunked prefill, the softcap and untied-head switches) runs in test_model_parity.py
as families "gemma3" and "gemma3_softcap"; hub-style VLM checkpoint names in test_vlm_parity.py. Here:
the model implements its sliding windows, so its context is not capped to the window."""

from __future__ import annotations

from foveal.models import max_context
from tests.tiny import tiny_config


def test_context_is_not_capped_to_the_window():
    import transformers as tf

    gemma = tiny_config("gemma3")
    gemma.architectures = ["Gemma3ForCausalLM"]
    assert max_context(gemma) == 512
    mistral = tf.MistralConfig(sliding_window=64, max_position_embeddings=512)
    mistral.architectures = ["MistralForCausalLM"]
    assert max_context(mistral) == 64
