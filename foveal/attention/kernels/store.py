"""Write this step's k/v [T, kv_heads, head_dim] into a paged cache [2, slots, kv_heads, head_dim].

One program per token moves all of its heads (one [kv_heads, head_dim] tile for K, one for V). A slot
below zero marks a row to skip: the padding rows of a CUDA-graph batch, whose inputs are junk.

    k[t] --slot_mapping[t]--> cache[0, slot]     (slot = block * block_size + offset)
    v[t] ------------------> cache[1, slot]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foveal.layers import pdl
from foveal.layers.pdl import begin


@triton.jit
def _store_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slots_ptr,
    stride_s,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,  # cache[0] -> cache[1]
    stride_slot,
    stride_ch,
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # (programmatic dependent launch: layers/pdl.py)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t * stride_s).to(tl.int64)  # int64: a large pool has more than 2**31 elements
    if slot < 0:
        return
    h = tl.arange(0, KV_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_slot + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (any strides) -> kv_cache at slot_mapping [T]
    (int32 or int64, any stride; rows with a negative slot are skipped)."""
    num_tokens, num_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (k, v))
    assert kv_cache.stride(3) == 1
    _store_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        slot_mapping.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        NUM_KV=num_kv,
        HEAD_DIM=head_dim,
        KV_PAD=triton.next_power_of_2(num_kv),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        **pdl.launch_args(k),
    )
