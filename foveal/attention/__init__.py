"""Attention backends behind one protocol (see base.py), looked up by name with lazy imports so the
CPU path never imports CUDA-only code."""

from __future__ import annotations

import importlib

import torch

from foveal.attention.base import AttentionBackend, AttentionBatch

_BACKENDS = {
    "torch": "foveal.attention.torch_backend:TorchAttentionBackend",
    "cpu": "foveal.attention.cpu_backend:CpuAttentionBackend",
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


def _cpu_kernel_available() -> bool:
    from foveal.attention import cpu_native

    return cpu_native.kernel() is not None


def get_backend(name: str, device) -> AttentionBackend:
    """'auto' picks triton on CUDA when it imports (triton is imported only then); on CPU, cpu (torch
    plus the native decode kernel) when the kernel builds, else torch."""
    if name == "auto":
        kind = torch.device(device).type
        if kind == "cuda":
            name = "triton" if _triton_available() else "torch"
        else:
            name = "cpu" if kind == "cpu" and _cpu_kernel_available() else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["AttentionBackend", "AttentionBatch", "available_backends", "get_backend"]
