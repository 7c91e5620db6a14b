"""Model registry: `config.architectures[0]` -> implementation, imported lazily."""

from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": "foveal.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "foveal.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "foveal.models.llama:Qwen2ForCausalLM",
    "MiMoForCausalLM": "foveal.models.llama:MiMoForCausalLM",
    "Qwen3ForCausalLM": "foveal.models.llama:Qwen3ForCausalLM",
    "LlamaModel": "foveal.models.llama:LlamaModel",  # embedding models: transformers' bare decoders
    "Qwen2Model": "foveal.models.llama:Qwen2Model",
    "Qwen3Model": "foveal.models.llama:Qwen3Model",
    "Qwen3MoeForCausalLM": "foveal.models.llama_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "foveal.models.llama_moe:MixtralForCausalLM",
    "GptOssForCausalLM": "foveal.models.gpt_oss:GptOssForCausalLM",
    "LLaDAModelLM": "foveal.models.llama:LLaDAModelLM",
    "SDARForCausalLM": "foveal.models.llama:SDARForCausalLM",
    "LlavaForConditionalGeneration": "foveal.models.llava:LlavaForConditionalGeneration",
    "LlavaOnevisionForConditionalGeneration": (
        "foveal.models.llava_onevision:LlavaOnevisionForConditionalGeneration"
    ),
    "Gemma3ForCausalLM": "foveal.models.gemma3_text:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "foveal.models.gemma3:Gemma3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration": "foveal.models.idefics3:Idefics3ForConditionalGeneration",
    "SmolVLMForConditionalGeneration": "foveal.models.idefics3:SmolVLMForConditionalGeneration",
    "Qwen2VLForConditionalGeneration": "foveal.models.qwen2_vl:Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration": "foveal.models.qwen2_vl:Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration": "foveal.models.qwen3_vl:Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration": "foveal.models.qwen3_vl:Qwen3VLMoeForConditionalGeneration",
    "Qwen2AudioForConditionalGeneration": "foveal.models.qwen2_audio:Qwen2AudioForConditionalGeneration",
    "Qwen2_5OmniThinkerForConditionalGeneration": (
        "foveal.models.qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration"
    ),
    # the whole model (thinker, talker, token2wav): its thinker only
    "Qwen2_5OmniForConditionalGeneration": (
        "foveal.models.qwen2_5_omni:Qwen2_5OmniThinkerForConditionalGeneration"
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def model_class(config):
    archs = list(getattr(config, "architectures", None) or [])
    if not archs:
        raise ValueError(
            f"the model config names no architecture; supported: {', '.join(supported_architectures())}"
        )
    arch = archs[0]
    if arch not in _MODELS:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}"
        )
    module, cls = _MODELS[arch].split(":")
    return getattr(importlib.import_module(module), cls)


def max_context(config) -> int:
    """The longest context the native model computes exactly: a model with an active sliding window is
    capped to it unless its class masks windows (`implements_sliding_window`, e.g. Gemma 3)."""
    try:
        windows_ok = bool(getattr(model_class(config), "implements_sliding_window", False))
    except ValueError:  # unsupported architecture: build_model names it
        windows_ok = False
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = int(getattr(config, "max_position_embeddings", 0) or 2048)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and not windows_ok:
        limit = min(limit, int(window))
    return limit


def build_model(config, backend, *, max_positions: int, dtype, device, weights):
    """Instantiate the native model without random init (meta device), then fill it from `weights`
    (None: random weights)."""
    import torch

    cls = model_class(config)
    with torch.device("meta"):
        model = cls(config, backend, max_positions)
    # cast while on meta (free), then allocate: a cast after to_empty would read and write every
    # parameter's memory (~0.4 s of start-up for the default model in bf16)
    model = model.to(dtype).to_empty(device=device)
    # meta tensors carry no values: models recompute their non-persistent buffers (rotary tables) and
    # VLMs build their transformers vision modules here, before the weights arrive
    model.reset_buffers(torch.device(device), dtype)
    if weights is None:  # --load-format dummy
        from foveal.loader.dummy import randomize_weights

        randomize_weights(model)
    else:
        model.load_weights(weights)
    return model.eval()
