"""Loads the CPU paged-attention kernel (cpu_attention.c, built through foveal.native). Where no compiler
works, `kernel()` is None and the CPU backend falls back to the torch backend's path (logged once).

    kernel().attend(q, k_pool, v_pool, tables, starts, lens, out, block_size, scale, softcap, sinks, row_seq)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from foveal import native

SOURCE = Path(__file__).with_name("cpu_attention.c")
_FUNCS = {
    torch.float32: "foveal_attend_f32",
    torch.bfloat16: "foveal_attend_bf16",
    torch.float16: "foveal_attend_f16",
}
_P, _I64, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_ARGTYPES = [_P, _I64, _P, _P, _I64, _P, _I64, _P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _F, _P, _I]


class AttentionKernel:
    def __init__(self, lib: ctypes.CDLL):
        self._fns = {}
        for dtype, name in _FUNCS.items():
            self._fns[dtype] = native.Entry(getattr(lib, name), _ARGTYPES)
        self._store = native.Entry(lib.foveal_kv_store, [_P, _P, _I64, _P, _P, _I64, _I64, _P, _I64, _I64])

    def store(self, k_pool, v_pool, slots, k, v) -> bool:
        """k, v [T, KVH, D] into rows `slots` [T] (int64) of k_pool / v_pool [slots, KVH, D]; False (and
        nothing written) for layouts it does not take: the caller's index_copy_ then does it."""
        row = k_pool.stride(0)
        if not (
            k.dtype == v.dtype == k_pool.dtype == v_pool.dtype
            and slots.dtype == torch.long
            and slots.is_contiguous()
            and k.shape == v.shape
            and k.shape[1:] == k_pool.shape[1:]
            and k_pool.stride(0) == v_pool.stride(0)
            and k_pool[0].is_contiguous()
            and k[0].is_contiguous()
            and v[0].is_contiguous()
            and k_pool.stride(0) == k[0].numel()
        ):
            return False
        n = k.shape[0]
        self._store(
            k_pool.data_ptr(), v_pool.data_ptr(), row * k_pool.element_size(), k.data_ptr(), v.data_ptr(),
            k.stride(0) * k.element_size(), v.stride(0) * v.element_size(), slots.data_ptr(), n,
            k_pool.shape[0],
        )  # fmt: skip
        return True

    def attend(
        self,
        q: torch.Tensor,  # [rows, H, D]: one query token a row
        k_pool: torch.Tensor,  # [slots, KVH, D]
        v_pool: torch.Tensor,
        tables: torch.Tensor,  # [sequences, max_blocks] int64 (a row's: tables[row_seq[row]])
        starts: torch.Tensor,  # [rows] int64: first visible position
        lens: torch.Tensor,  # [rows] int64: the row sees keys [start, len)
        out: torch.Tensor,  # [rows, H, D], contiguous
        block_size: int,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [H] float32 attention-sink logits, or None
        row_seq: torch.Tensor | None = None,  # [rows] int64: each row's sequence; None: row i is sequence i
    ) -> torch.Tensor:
        """Each row attends to keys [start, len) of its sequence; a row's result depends on nothing
        else (not on the other rows, their number or their order)."""
        nd, heads, dim = q.shape
        if sinks is not None and not (sinks.dtype == torch.float32 and sinks.is_contiguous()):
            raise ValueError("sinks must be contiguous float32 [heads]")
        kv_heads = k_pool.shape[1]
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        for t in (k_pool, v_pool):
            if t.stride(2) != 1 or t.stride(1) != dim or t.stride(0) != k_pool.stride(0):
                raise ValueError("the KV pool must be [slots, kv_heads, head_dim] with rows in place")
        if not (out.is_contiguous() and tables.is_contiguous() and tables.dtype == torch.long):
            raise ValueError("out and tables must be contiguous (tables int64)")
        if row_seq is not None and not (row_seq.dtype == torch.long and row_seq.is_contiguous()):
            raise ValueError("row_seq must be contiguous int64")
        if not (q.dtype == k_pool.dtype == v_pool.dtype == out.dtype) or q.dtype not in self._fns:
            raise ValueError(f"unsupported dtypes {q.dtype}/{k_pool.dtype}/{out.dtype}")
        self._fns[q.dtype](
            q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), k_pool.stride(0),
            tables.data_ptr(), tables.stride(0), None if row_seq is None else row_seq.data_ptr(),
            starts.data_ptr(), lens.data_ptr(), out.data_ptr(),
            nd, heads, kv_heads, dim, block_size, scale, softcap or 0.0,
            None if sinks is None else sinks.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return out


@functools.cache
def kernel() -> AttentionKernel | None:
    """The built kernel, or None (no compiler, a failed build: logged once)."""
    lib = native.load(SOURCE, "CPU paged-attention kernel")
    return None if lib is None else AttentionKernel(lib)
