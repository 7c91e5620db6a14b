"""Foveal: a fast, compact serving engine for vision-language and text models."""

from foveal.request import FinishReason, SamplingParams, TokenDelta

__version__ = "0.1.0"


def __getattr__(name):  # keep `import foveal` light: torch loads only when the engine is used
    if name in ("LLM", "LoRARequest"):
        from foveal.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "LoRARequest", "FinishReason", "SamplingParams", "TokenDelta", "__version__"]
