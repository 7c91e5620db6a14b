"""Triton kernels of the triton attention backend, each with a thin launch wrapper that takes torch
tensors and host ints only (no device reads), so a step built from them can be captured in a CUDA graph.

    store.py    this step's k/v -> the paged cache (slot < 0: padding row, skipped)
    decode.py   one query token per sequence, split-KV (flash-decoding) + a log-sum-exp combine
    prefill.py  varlen chunks with cached context (flash-attention style), GQA heads folded into rows

Importing this package imports triton: only triton_backend.py does, and only when it is chosen. Under
TRITON_INTERPRET=1 (CPU tests) the same kernels run in Triton's interpreter on CPU tensors.
"""

from foveal.attention.kernels.decode import paged_decode
from foveal.attention.kernels.prefill import paged_prefill
from foveal.attention.kernels.store import store_kv

__all__ = ["paged_decode", "paged_prefill", "store_kv"]
