"""Attention backends behind one protocol (see base.py), looked up by name with lazy imports so the
CPU path never imports CUDA-only code."""

from __future__ import annotations

import importlib

import torch

from foveal.attention.base import AttentionBackend, AttentionBatch

_BACKENDS = {
    "torch": "foveal.attention.torch_backend:TorchAttentionBackend",
    "triton": "foveal.attention.triton_backend:TritonAttentionBackend",
}


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_backend(name: str, device) -> AttentionBackend:
    """'auto' picks triton on CUDA when it imports, else torch (triton is imported only then)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" and _triton_available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "AttentionBatch", "available_backends", "get_backend"]
