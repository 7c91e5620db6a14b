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
