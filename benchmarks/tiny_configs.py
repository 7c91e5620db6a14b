"""Tiny configs of the three benchmark families, from the real transformers config classes, written
as `<name>.json` beside each other like benchmarks/configs/: the CPU smoke runs of gpu_workloads.py
(`--smoke`) and hf_baseline.py (`--tiny`) load them through the same path as the real ones."""

from __future__ import annotations

import os

SMALL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)


def write_tiny_configs(folder: str) -> dict[str, str]:
    """{"llama-3.1-8b" | "qwen3-0.6b" | "qwen2.5-vl-7b": path of its tiny config.json file}."""
    from transformers import LlamaConfig, Qwen2_5_VLConfig, Qwen3Config

    llama3_rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    configs = {
        "llama-3.1-8b": LlamaConfig(vocab_size=1024, rope_scaling=llama3_rope, rope_theta=500000.0, **SMALL),
        # vocab > 10000: nano-vllm's W3 prompts use ids in [0, 10000)
        "qwen3-0.6b": Qwen3Config(vocab_size=12000, tie_word_embeddings=True, **SMALL),
        "qwen2.5-vl-7b": Qwen2_5_VLConfig(
            text_config={
                "vocab_size": 2048,
                "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                **SMALL,
            },
            vision_config={
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 112,
                "fullatt_block_indexes": [1],
            },
            image_token_id=2000,
            video_token_id=2001,
            vision_start_token_id=2002,
            vision_end_token_id=2003,
        ),
    }
    archs = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    paths = {}
    for name, cfg in configs.items():
        cfg.architectures = [archs.get(cfg.model_type, "Qwen2_5_VLForConditionalGeneration")]
        paths[name] = os.path.join(folder, f"{name}.json")
        with open(paths[name], "w") as f:
            f.write(cfg.to_json_string())
    return paths
