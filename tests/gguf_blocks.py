"""For tests of GGUF blocks: writers of llama.cpp's K-quant blocks (gguf-py reads them but cannot write
them): Q4_K and Q6_K from float weights, plainly (a scale per sub-block from its range, no search), and
random blocks of any type, gguf's own `dequantize` judging them (test_quant_linear.py); the bounds the
repacked types keep; and the checks of an engine on packed weights against one on dense."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def _superblocks(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float32)
    if a.shape[-1] % 256:
        raise ValueError(f"K-quants take rows of whole 256-weight superblocks, not {a.shape[-1]}")
    return a.reshape(-1, 256)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def q4_k(a: np.ndarray) -> np.ndarray:
    """[..., K] -> uint8 [..., K / 256 * 144]: d, dmin (fp16), 12 bytes of 6-bit scales and mins of the
    eight 32-weight sub-blocks, 128 bytes of nibbles; w = d sc q - dmin m."""
    x = _superblocks(a).reshape(-1, 8, 32)
    lo = np.minimum(x.min(-1), 0)
    scale, mins = (x.max(-1) - lo) / 15, -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = (
        np.where(d[:, None] > 0, np.rint(scale / np.maximum(d[:, None], 1e-30)), 0)
        .clip(0, 63)
        .astype(np.uint8)
    )
    m = (
        np.where(dmin[:, None] > 0, np.rint(mins / np.maximum(dmin[:, None], 1e-30)), 0)
        .clip(0, 63)
        .astype(np.uint8)
    )
    step = (d[:, None] * sc)[..., None]
    q = np.where(step > 0, np.rint((x + (dmin[:, None] * m)[..., None]) / np.maximum(step, 1e-30)), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # chunks of 64: low nibbles, then high
    scales = np.zeros((len(x), 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    scales[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    out = np.concatenate([_half_bytes(d), _half_bytes(dmin), scales, qs], axis=1)
    return out.reshape(*np.shape(a)[:-1], -1)


def q6_k(a: np.ndarray) -> np.ndarray:
    """[..., K] -> uint8 [..., K / 256 * 210]: 128 bytes of low nibbles, 64 of high bit pairs, sixteen
    int8 scales of 16-weight sub-blocks, d (fp16); w = d sc (q - 32)."""
    x = _superblocks(a).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 32
    d = (scale.max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(scale / np.maximum(d[:, None], 1e-30)), 0).clip(-127, 127)
    step = (d[:, None] * sc)[..., None]
    q = np.where(step > 0, np.rint(x / np.maximum(step, 1e-30)), 0).clip(-32, 31) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # halves of 128: four runs of 32
    ql = np.concatenate(
        [q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], 2
    )
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _half_bytes(d)], axis=1
    )
    return out.reshape(*np.shape(a)[:-1], -1)


WRITERS = {"Q4_K": q4_k, "Q6_K": q6_k}

# where each type keeps its fp16 scale fields (d, and dmin or m): random blocks get small finite ones
_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
           "Q4_0": (0,), "Q4_1": (0, 2)}  # fmt: skip


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0, scale: float = 1e-3) -> np.ndarray:
    """uint8 [rows, bytes] of random `kind` blocks whose fp16 scale fields lie in [scale, 4 scale)."""
    size, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
    for at in _SCALES[kind]:
        v = rng.uniform(scale, 4 * scale, raw.shape[:2]).astype(np.float16)
        raw[..., at : at + 2] = v.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def within_int8_step(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got is want requantized to int8 per block of 32: each weight within half a step, max|w| / 254 (the
    step's fp16 rounding aside), and not all equal (that would be no requantization)."""
    blocks = want.reshape(want.shape[0], -1, 32)
    bound = blocks.abs().amax(-1, keepdim=True) / 254 * (1 + 2**-10)
    err = (got.reshape(blocks.shape) - blocks).abs()
    return bool((err <= bound).all()) and bool((err > 0).any())


def within_q4_k_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got is Q4_K's want with each sub-block's scale and min rounded to fp16: at most 2^-11 of each term,
    3 x 2^-11 of the block's largest weight."""
    blocks = want.reshape(want.shape[0], -1, 32)
    err = (got.reshape(blocks.shape) - blocks).abs()
    return bool((err <= 3 * 2**-11 * blocks.abs().amax(-1, keepdim=True)).all())


def check_against_dense(packed, dense) -> None:
    """Two LLMs on one GGUF, quantization gguf and none: next-token log-probabilities of two prompts
    near the dense engine's (the same top token, within 0.05), and the packed one's greedy tokens
    batched equal to each prompt's alone."""
    from foveal import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for ids in ([5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40]):
        lq, ld = (llm.generate([ids], params)[0].outputs[0].logprobs[0].top for llm in (packed, dense))
        lq, ld = {t.token_id: t.logprob for t in lq}, {t.token_id: t.logprob for t in ld}
        top = max(ld, key=ld.get)
        assert max(lq, key=lq.get) == top and abs(lq[top] - ld[top]) < 0.05, (lq, ld)
    prompts = [[5, 9, 14, 3], [7, 7, 30, 2, 8, 1, 40], [11, 12]]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in packed.generate(prompts, greedy)]
    assert together == [packed.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
