"""Packed token bitmasks: allocate them, and apply them to a logits matrix in place.

A bitmask is int32 [n, ceil(vocab_size / 32)]; bit i of word j is token 32*j + i (1: allowed).
Row i of the bitmask masks logits row rows[i] (rows=None: row i), so constrained and free rows share
one batch and only the constrained ones pay for a mask; a negative entry in rows skips that mask row
(padding of a fixed-size, CUDA-graph-friendly rows tensor):

    logits [B, V]        bitmask [n, W]       rows [n]
    row 0  (free)        ------------         -
    row 1  <------------ mask 0 ------------- 1
    row 2  <------------ mask 1 ------------- 2
    row 3  (free)

Disallowed tokens become -inf, and so does every column at or past 32*W (logits wider than the mask:
the model's padded LM head), so padding ids can never be drawn. Bits past the tokenizer's vocabulary
inside the last word are whatever the filler wrote: llguidance writes 0.

Two implementations with one contract: torch (CPU; a byte lookup table unpacks the bits) and a Triton
kernel for CUDA (one program per (mask row, column block); Triton is imported at the first call, so the
CPU path never needs it; under TRITON_INTERPRET=1 it runs on CPU tensors, which is how it is tested).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

_BLOCK = 2048  # columns per Triton program


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """A CPU int32 [rows, ceil(vocab_size / 32)] bitmask with every token allowed (fillers overwrite
    rows; pin it to copy it to the GPU without blocking)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin_memory)


_LUTS: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _expand(bitmask: torch.Tensor, allowed: bool) -> torch.Tensor:
    """bool [n, 32 * words], one column per token: True where the bit is `allowed` (1) or not (0)."""
    n, words = bitmask.shape
    if sys.byteorder != "little":  # byte order matters below; torch runs little-endian in practice
        shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
        return (((bitmask.unsqueeze(-1) >> shifts) & 1) == int(allowed)).view(n, words * 32)
    key = (bitmask.device, allowed)
    lut = _LUTS.get(key)
    if lut is None:  # byte value -> its 8 bits, low bit first (= token order)
        b = torch.arange(256, dtype=torch.int32).unsqueeze(1) >> torch.arange(8, dtype=torch.int32)
        lut = _LUTS[key] = ((b & 1) == int(allowed)).to(bitmask.device)
    # byte k of a row holds tokens 8k..8k+7; a table lookup per byte beats shifting every token's bit
    idx = bitmask.contiguous().view(torch.uint8).flatten().to(torch.int32)
    return lut.index_select(0, idx).view(n, words * 32)


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """bool [n, width]: True where allowed; columns at or past 32 * words are False."""
    n, words = bitmask.shape
    bits = _expand(bitmask, allowed=True)
    if width <= words * 32:
        return bits[:, :width]
    return torch.cat([bits, bits.new_zeros(n, width - words * 32)], dim=1)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows) -> None:
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError("logits must be [rows, vocab] and bitmask [rows, words]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    if rows is None and bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"{bitmask.shape[0]} mask rows for {logits.shape[0]} logits rows: pass rows")
    if rows is not None and len(rows) != bitmask.shape[0]:
        raise ValueError(f"{len(rows)} row indices for {bitmask.shape[0]} mask rows")


def _rows_tensor(rows, device: torch.device) -> torch.Tensor:
    if isinstance(rows, torch.Tensor):
        return rows.to(device=device, dtype=torch.int32)
    return torch.tensor(list(rows), dtype=torch.int32, device=device)


def apply_bitmask(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """In place: the Triton kernel for CUDA logits, the torch version otherwise."""
    if logits.is_cuda:
        apply_bitmask_triton(logits, bitmask, rows)
    else:
        apply_bitmask_torch(logits, bitmask, rows)


def apply_bitmask_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    _check(logits, bitmask, rows)
    if bitmask.shape[0] == 0:
        return
    cut = min(logits.shape[1], bitmask.shape[1] * 32)  # columns past the mask: always -inf
    disallowed = _expand(bitmask.to(logits.device), allowed=False)[:, :cut]
    if rows is None:
        logits[:, :cut].masked_fill_(disallowed, float("-inf"))
        logits[:, cut:] = float("-inf")
        return
    rows = rows.tolist() if isinstance(rows, torch.Tensor) else rows
    for i, r in enumerate(rows):  # row views: no gather / scatter copies of the logits
        if r >= 0:
            logits[r, :cut].masked_fill_(disallowed[i], float("-inf"))
            logits[r, cut:] = float("-inf")


_kernel = None


def _triton_kernel():
    """The kernel, defined (and Triton imported) at the first call."""
    global _kernel, tl
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl  # global: @triton.jit resolves names in the module's globals

    @triton.jit
    def _apply_bitmask_kernel(
        logits_ptr,
        bitmask_ptr,
        rows_ptr,
        logits_stride,
        bitmask_stride,
        n_cols,
        n_words,
        HAS_ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)
        if HAS_ROWS:
            row = tl.load(rows_ptr + i).to(tl.int64)
        else:
            row = i.to(tl.int64)
        if row < 0:  # a padding entry of rows
            return
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        word = cols // 32
        bits = tl.load(bitmask_ptr + i.to(tl.int64) * bitmask_stride + word, mask=word < n_words, other=0)
        allowed = (bits >> (cols % 32)) & 1  # past the last word: 0, so padding columns are masked
        neg_inf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + cols, neg_inf, mask=(cols < n_cols) & (allowed == 0))

    _kernel = _apply_bitmask_kernel
    return _kernel


def apply_bitmask_triton(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None
) -> None:
    """The Triton version (CUDA tensors; CPU tensors under TRITON_INTERPRET=1). No device reads: with
    the bitmask and an int32 rows tensor already on the device, it can be captured in a CUDA graph."""
    _check(logits, bitmask, rows)
    n, n_cols = bitmask.shape[0], logits.shape[1]
    if n == 0 or n_cols == 0:
        return
    if logits.stride(1) != 1:
        raise ValueError("logits must have unit stride along the vocabulary")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if bitmask.stride(1) != 1:
        bitmask = bitmask.contiguous()
    rows_t = _rows_tensor(rows, logits.device) if rows is not None else bitmask  # unused pointer if None
    grid = (n, (n_cols + _BLOCK - 1) // _BLOCK)
    _triton_kernel()[grid](
        logits,
        bitmask,
        rows_t,
        logits.stride(0),
        bitmask.stride(0),
        n_cols,
        bitmask.shape[1],
        HAS_ROWS=rows is not None,
        BLOCK=_BLOCK,
    )
