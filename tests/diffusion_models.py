"""Tiny random diffusion-LM checkpoints in their published layouts, and the transformers model each one
equals (the reference the tests compare Foveal with).

    write_llada(folder)  LLaDA-8B's layout: config.json with model_type "llada" and OLMo-style fields,
                         tensors named model.transformer.{wte, blocks.i.*, ln_f, ff_out}.weight
    write_sdar(folder)   SDAR's layout: a Qwen3 config.json with model_type "sdar", block_size and
                         mask_token_id (plus its training-only fields), Qwen3's tensor names
    hf_model(path)       the transformers model of such a folder (LlamaForCausalLM with the tensors
                         renamed back, or Qwen3ForCausalLM), float32, eval mode, eager attention

Sizes: hidden 64, 2 layers, 4 heads of 16 (LLaDA: 4 kv heads, as LLaDA-8B is MHA; SDAR: 2), MLP 128,
300 embedding rows, 512 positions. The tokenizer is tests/test_loader.py's (262 tokens) plus the mask
token, which thereby gets id 262 (MASK_ID): inside the vocabulary, below its padded tail, as in the
published checkpoints. eos = 2 (<|im_end|>), pad = 0, bos = 1.

The weights are drawn so that the paths under test matter: projections N(0, 1/fan_in) (attention
scores of order 1, so a wrong mask moves the logits by far more than rounding), embeddings N(0, 1),
norm scales 1 + N(0, 0.1^2), and a head giving logits of std ~4 (peaked distributions: confidences
spread over (0, 1), some above 0.9).

The mapping between LLaDA's names and Llama's is written here independently of foveal's
(foveal/models/llama.py `llada_tensor_name`, foveal/loader/safetensors_loader.py `llada_config`).
"""

from __future__ import annotations

import json
import math
import os

import torch

VOCAB = 300  # embedding rows (LLaDA's embedding_size; SDAR's vocab_size)
LLADA_TOKENIZER_VOCAB = 280  # LLaDA's vocab_size field: less than embedding_size, as OLMo pads it
MASK_ID = 262
EOS_ID, BOS_ID, PAD_ID = 2, 1, 0
HIDDEN, LAYERS, HEADS, HEAD_DIM, INTER, MAX_POS = 64, 2, 4, 16, 128, 512

# Llama (HF) name under model.layers.i. -> LLaDA's under model.transformer.blocks.i.
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "q_proj",
    "self_attn.k_proj": "k_proj",
    "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "attn_out",
    "post_attention_layernorm": "ff_norm",
    "mlp.gate_proj": "ff_proj",
    "mlp.up_proj": "up_proj",
    "mlp.down_proj": "ff_out",
}
_TOP = {"model.embed_tokens": "model.transformer.wte", "model.norm": "model.transformer.ln_f",
        "lm_head": "model.transformer.ff_out"}  # fmt: skip


def llada_name(hf_name: str) -> str:
    """HF Llama tensor name -> the LLaDA checkpoint's."""
    for ours, theirs in _TOP.items():
        if hf_name.startswith(ours + "."):
            return theirs + hf_name[len(ours) :]
    parts = hf_name.split(".")  # model.layers.{i}.<module...>.{weight,bias}
    assert parts[:2] == ["model", "layers"], hf_name
    module, suffix = ".".join(parts[3:-1]), parts[-1]
    return f"model.transformer.blocks.{parts[2]}.{_BLOCK[module]}.{suffix}"


def llada_config(**overrides) -> dict:
    """LLaDA-8B-Instruct's config.json fields at tiny sizes (the published values elsewhere)."""
    cfg = {
        "architectures": ["LLaDAModelLM"],
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModel": "modeling_llada.LLaDAModelLM",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        },
        "model_type": "llada",
        "activation_type": "silu",
        "alibi": False,
        "alibi_bias_max": 8.0,
        "attention_dropout": 0.0,
        "attention_layer_norm": False,
        "attention_layer_norm_with_affine": True,
        "bias_for_layer_norm": False,
        "block_group_size": 1,
        "block_type": "llama",
        "d_model": HIDDEN,
        "embedding_dropout": 0.0,
        "embedding_size": VOCAB,
        "eos_token_id": EOS_ID,
        "flash_attention": False,
        "include_bias": False,
        "include_qkv_bias": False,
        "init_cutoff_factor": None,
        "init_device": "meta",
        "init_fn": "mitchell",
        "init_std": 0.02,
        "input_emb_norm": False,
        "layer_norm_type": "rms",
        "layer_norm_with_affine": True,
        "mask_token_id": MASK_ID,
        "max_sequence_length": MAX_POS,
        "mlp_hidden_size": INTER,
        "mlp_ratio": 4,
        "multi_query_attention": None,
        "n_heads": HEADS,
        "n_kv_heads": HEADS,
        "n_layers": LAYERS,
        "pad_token_id": PAD_ID,
        "precision": "amp_bf16",
        "residual_dropout": 0.0,
        "rms_norm_eps": 1e-5,
        "rope": True,
        "rope_full_precision": True,
        "rope_theta": 500000.0,
        "scale_logits": False,
        "torch_dtype": "float32",
        "use_cache": False,
        "vocab_size": LLADA_TOKENIZER_VOCAB,
        "weight_tying": False,
    }
    cfg.update(overrides)
    return cfg


def llama_config_of_llada(cfg: dict):
    """The transformers LlamaConfig a LLaDA config.json describes (eager attention)."""
    from transformers import LlamaConfig

    bias = bool(cfg.get("include_bias"))
    return LlamaConfig(
        vocab_size=cfg.get("embedding_size") or cfg["vocab_size"],
        hidden_size=cfg["d_model"],
        intermediate_size=cfg["mlp_hidden_size"],
        num_hidden_layers=cfg["n_layers"],
        num_attention_heads=cfg["n_heads"],
        num_key_value_heads=cfg.get("n_kv_heads") or cfg["n_heads"],
        max_position_embeddings=cfg["max_sequence_length"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        tie_word_embeddings=cfg["weight_tying"],
        attention_bias=bias,
        mlp_bias=bias,
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        attn_implementation="eager",
    )


def sdar_config(block_size: int = 4, **overrides) -> dict:
    """SDAR-4B-Chat's config.json fields at tiny sizes (the published values elsewhere)."""
    cfg = {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
        "model_type": "sdar",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_implementation": "flex_attention",
        "block_size": block_size,
        "bos_token_id": EOS_ID,  # SDAR's config names one id for both
        "debug": False,
        "eos_token_id": EOS_ID,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTER,
        "mask_token_id": MASK_ID,
        "max_position_embeddings": MAX_POS,
        "max_window_layers": LAYERS,
        "micro_forward": False,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "skip_checkpoint": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_deepep": False,
        "use_sliding_window": False,
        "vocab_size": VOCAB,
    }
    cfg.update(overrides)
    return cfg


def qwen3_config_of_sdar(cfg: dict):
    """The transformers Qwen3Config an SDAR config.json describes (eager attention)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg["head_dim"],
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
        attention_bias=cfg["attention_bias"],
        tie_word_embeddings=cfg["tie_word_embeddings"],
        use_sliding_window=False,
        eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        attn_implementation="eager",
    )


def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.startswith("lm_head"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))  # logits of std ~4 over hidden 64
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))


def _tokenizer():
    from tests.test_loader import tiny_hf_tokenizer

    tok = tiny_hf_tokenizer()
    tok.add_special_tokens({"mask_token": "<|mdm_mask|>"})
    assert tok.convert_tokens_to_ids("<|mdm_mask|>") == MASK_ID
    return tok


def _write(folder, cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _tokenizer().save_pretrained(folder)
    return folder


def write_llada(folder, seed: int = 0, **cfg_overrides) -> str:
    """A tiny random LLaDA checkpoint in LLaDA-8B's layout at `folder`; returns its path. Overrides
    replace config.json fields (e.g. weight_tying=True: no model.transformer.ff_out; include_bias)."""
    from transformers import LlamaForCausalLM

    cfg = llada_config(**cfg_overrides)
    model = LlamaForCausalLM(llama_config_of_llada(cfg))
    _randomize(model, seed)
    sd = model.state_dict()
    if cfg["weight_tying"]:
        sd.pop("lm_head.weight")
    return _write(folder, cfg, {llada_name(k): v for k, v in sd.items()})


def write_sdar(folder, seed: int = 0, block_size: int = 4, **cfg_overrides) -> str:
    """A tiny random SDAR checkpoint in SDAR's published layout at `folder`; returns its path."""
    from transformers import Qwen3ForCausalLM

    cfg = sdar_config(block_size, **cfg_overrides)
    model = Qwen3ForCausalLM(qwen3_config_of_sdar(cfg))
    _randomize(model, seed)
    sd = model.state_dict()
    if cfg["tie_word_embeddings"]:
        sd.pop("lm_head.weight")
    return _write(folder, cfg, sd)


def hf_model(path: str):
    """The transformers model equal to the checkpoint at `path` (float32, eval, eager attention):
    LlamaForCausalLM with LLaDA's tensors renamed back, or Qwen3ForCausalLM for SDAR. It is causal by
    default: give it the diffusion mask as a 4-D additive attention_mask (tests/diffusion_reference.py)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    if cfg["model_type"] == "llada":
        model = LlamaForCausalLM(llama_config_of_llada(cfg))
        back = {llada_name(k): k for k in model.state_dict()}
        tensors = {back[k]: v for k, v in tensors.items()}
    elif cfg["model_type"] == "sdar":
        model = Qwen3ForCausalLM(qwen3_config_of_sdar(cfg))
    else:
        raise ValueError(f"not a diffusion checkpoint: model_type {cfg['model_type']!r}")
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(missing) <= tied and not unexpected, (missing, unexpected)
    if tied:
        model.tie_weights()
    return model.to(torch.float32).eval()
