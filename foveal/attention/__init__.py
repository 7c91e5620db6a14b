"""Attention backends behind one protocol (see base.py), looked up by name with lazy imports so the
CPU path never imports CUDA-only code."""

from __future__ import annotations

import importlib

from foveal.attention.base import AttentionBackend, AttentionBatch

_BACKENDS = {
    "torch": "foveal.attention.torch_backend:TorchAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def get_backend(name: str, device) -> AttentionBackend:
    """'auto' picks the best backend for the device (only `torch` exists so far)."""
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "AttentionBatch", "available_backends", "get_backend"]
