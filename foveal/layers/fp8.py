"""Block-quantized FP8 weights (Qwen3-*-FP8, DeepSeek's layout): float8 values and one float32
`weight_scale_inv` per block of [rows, cols], the weight being their product.

Owns the arithmetic (dequantize_blocks) and the rule for when a mixture's experts run as stored
(expert_block); the loader, the parameter filler and FusedMoE use both. Must not read files.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [rows, cols] (fp8) times its block's scale, in float32 (blocks at the edges may be partial)."""
    br, bc = block
    rows, cols = w.shape
    s = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w.float() * s


def expert_block(config, hidden: int, intermediate: int) -> int | None:
    """The block a mixture's experts keep their FP8 values in (the experts kernel dequantizes them as it
    reads them: moe_triton.experts_triton's `wq13`, `wq2`), or None: they are dequantized at load.
    Kept where the checkpoint is block-quantized FP8 (quantization_config: quant_method "fp8", a square
    weight_block_size of a power of two >= 16, experts not among the modules left unquantized) and
    each expert's gate, up and down rows fill whole blocks (hidden and intermediate multiples of it)."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    block = q.get("weight_block_size")
    if q.get("quant_method") != "fp8" or not block or len(block) != 2 or block[0] != block[1]:
        return None
    b = int(block[0])
    skipped = list(q.get("modules_to_not_convert") or ()) + list(q.get("ignored_layers") or ())
    if b < 16 or b & (b - 1) or hidden % b or intermediate % b or any("experts" in m for m in skipped):
        return None
    return b
