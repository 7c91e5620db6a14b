"""Shared by the Triton kernel tests run on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def interpreter_rounds_to_nearest_even():
    """Triton 3.9's interpreter truncates fp32 -> bf16 casts where the GPU rounds to nearest even;
    make it round as the GPU does, for this module's tests only."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def rtne_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(data.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.cast_impl = rtne_cast
    yield
    builder.cast_impl = cast_impl


def speed_up_interpreter() -> None:
    """Triton's interpreter, faster where it repeats work whose result it already has or never reads
    (each below says what); what a kernel computes stays the same, bit for bit."""
    patch_language_once_per_launch()
    skip_dead_overflow_checks()
    remember_numpy_dtypes()


def patch_language_once_per_launch() -> bool:
    """Triton's interpreter patches triton.language into its interpreted forms when a kernel launch
    starts (and restores it when the launch ends), and again at every call of a @triton.jit device
    function from inside it: ~3 ms a call here (it walks the modules' members), paid per program and per
    loop iteration that calls a helper (the sampler's, the attention tiles', `pdl.begin`, tl.zeros).
    Inside a launch that already patched the same modules the second patch changes nothing, so device
    calls skip it; everything else runs as Triton runs it. Returns whether it is installed (False where
    this Triton's interpreter is not shaped as 3.x's is: the tests then run at its own speed)."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as ti

    grid, device = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid is None or device is None or not hasattr(ti, "_patch_lang"):
        return False
    grid_call, device_call = grid.__call__, device.__call__
    if getattr(device_call, "_patches_once", False):
        return True
    launches: list[frozenset[int]] = []  # per running launch: the language modules patched so far
    seen: dict[object, frozenset[int]] = {}

    def modules(fn) -> frozenset[int]:  # what _patch_lang patches for fn: tl / tl.core among its globals
        out = seen.get(fn)
        if out is None:
            vals = fn.__globals__.values()
            out = seen[fn] = frozenset(id(v) for v in vals if inspect.ismodule(v) and v in (tl, tl.core))
        return out

    def launch(self, *args, **kwargs):
        launches.append(modules(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def call(self, *args, **kwargs):
        fn = self.rewrite()  # (rewriting may add the interpreter's names to fn's globals: then compared)
        if not launches:
            return device_call(self, *args, **kwargs)
        mods = modules(self.fn)
        if not mods <= launches[-1]:  # (triton.language.standard's helpers see tl.core, kernels tl)
            launches[-1] |= mods  # patched for the rest of the launch (a device call's patch stays)
            return device_call(self, *args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    call._patches_once = True
    grid.__call__, device.__call__ = launch, call
    return True


def skip_dead_overflow_checks() -> bool:
    """Triton's integer-overflow sanitizer redoes every int32 add, sub and mul of a kernel in int64,
    compares the result with the type's range and hands the comparison to `device_assert`, which does
    nothing unless the options' `debug` is on. The interpreter's options are fixed with debug off, so
    that work is dead (~40% of the sampler's distribution test): with debug off it is switched off, and
    nothing a kernel computes changes. Returns whether it is (False where this Triton's interpreter is
    shaped otherwise, or debugs: then the checks run as Triton runs them)."""
    import dataclasses

    from triton.runtime import interpreter as ti

    builder = getattr(ti, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not dataclasses.is_dataclass(options) or getattr(options, "debug", True):
        return False
    if not getattr(options, "sanitize_overflow", False):
        return True
    builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True


def remember_numpy_dtypes() -> bool:
    """The interpreter's `_get_np_dtype` builds its table of 19 Triton -> numpy dtypes at every call
    (hundreds of thousands of calls in a test: ~9% of the sampler's distribution test). Its answer for a
    block is its element's, so answers are kept per element dtype, each the function's own. Returns
    whether it is installed (False where this Triton's interpreter has no such function)."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    real = getattr(ti, "_get_np_dtype", None)
    if real is None or getattr(real, "_remembers", False):
        return real is not None
    known: dict = {}
    pointer = real(tl.pointer_type(tl.int8))  # every pointer's (pointer types are not hashable)

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return pointer
        out = known.get(key)
        if out is None:
            out = known[key] = real(tt_dtype)
        return out

    np_dtype._remembers = True
    ti._get_np_dtype = np_dtype
    return True
