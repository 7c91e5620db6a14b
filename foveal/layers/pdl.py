"""Programmatic dependent launch (Hopper and later) for the decode step's small Triton kernels.

A decode step at batch 1 is a chain of short kernels (norms, rotary, the KV store, attention and its
combine, the routing, the experts, their sum), each paying the launch of the next and a ramp at its
start. Launched with the programmatic-serialization attribute, a kernel is let onto the GPU as soon as
every program of the kernel before it has started (each calls `gdc_launch_dependents` first), and its
programs wait in `gdc_wait` until that kernel has finished and its writes are visible: the launch and
scheduling overlap the previous kernel's run, no memory is touched early, so the order of effects is the
stream's. A kernel after a plain launch (cuBLAS's) waits as usual; so does a plain kernel after one of
these. CUDA graphs keep the dependency (stream capture records it as a programmatic edge).

    begin(PDL)            the first statement of a kernel that takes part
    launch_args(x)        {"PDL": ..., **launch option}: its launch on x's device

On by default (FOVEAL_PDL=0 turns it off); never in Triton's interpreter or below compute capability 9.
Batch-1 decode steps on an H100, one engine each way, alternating (`benchmarks/moe.py --pdl 0,1`,
RESULTS.md session 38): Qwen3-30B-A3B 3.88 -> 3.60 ms (two runs each), gpt-oss-20b 3.41 -> 3.32 ms;
Llama-3.1-8B (W1, whose step is mostly cuBLAS's GEMMs) 5.90 -> 5.84 ms.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from foveal.config import triton_interpreted

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: never enabled
    gdc_launch_dependents = gdc_wait = None

ENABLED = os.environ.get("FOVEAL_PDL", "1") != "0"


@triton.jit
def begin(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one has started, then wait for the kernel
    before this one to finish (its writes visible): call before any load or store."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def _capable(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def on(x: torch.Tensor) -> bool:
    """Whether kernels launched for x's device take part."""
    if not (ENABLED and x.is_cuda) or triton_interpreted():
        return False
    return _capable(x.device.index if x.device.index is not None else torch.cuda.current_device())


def launch_args(x: torch.Tensor) -> dict:
    """The PDL constexpr and, where on, the launch option that sets the attribute."""
    return {"PDL": True, "launch_pdl": True} if on(x) else {"PDL": False}
