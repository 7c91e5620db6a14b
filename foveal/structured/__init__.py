"""Structured outputs: grammar specs, compiled grammars and per-request matchers, token bitmasks.

spec.py                OutputConstraint, from the request shapes (response_format, structured_outputs)
backend.py             the GrammarBackend / CompiledGrammar / Matcher protocol; GrammarCache
limits.py              size limits checked before a grammar reaches the native compiler
llguidance_backend.py  the default backend (imports llguidance: only when asked for, below)
guide.py, closing.py   one request's steering (grammar, think block, budget); closing at max_tokens
bitmask.py             packed int32 masks: allocate, apply to logits (torch on CPU, Triton on CUDA)
"""

from foveal.structured.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCache,
    GrammarCacheStats,
    Matcher,
)
from foveal.structured.bitmask import allocate_bitmask, apply_bitmask, bitmask_words
from foveal.structured.constraint import GrammarKind, OutputConstraint

__all__ = [
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarCache",
    "GrammarCacheStats",
    "GrammarKind",
    "OutputConstraint",
    "LLGuidanceBackend",
    "Matcher",
    "allocate_bitmask",
    "apply_bitmask",
    "bitmask_words",
]


def __getattr__(name: str):
    if name == "LLGuidanceBackend":
        from foveal.structured.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
