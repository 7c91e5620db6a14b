"""Rotary position embeddings (RoPE): inverse frequencies for the rope types we support, a cos/sin
table indexed by absolute position, and the rotate-half application used by Llama and Qwen.

Supported rope types: default, linear, llama3, yarn (gpt-oss: frequencies ramped between extrapolated
and interpolated ones, cos/sin scaled by the attention factor). Anything else raises a clear error at
model build.

M-RoPE (Qwen2-VL family): positions are [3, T] (temporal, height, width); `mrope_section` splits the
head_dim/2 rotary frequencies into consecutive sections, section i taking its angle from axis i % 3.
Qwen3-VL interleaves instead (frequencies cycle t, h, w, ...; see `mrope_axes`). Same cos/sin table as
the 1-D path, gathered per frequency from the axis that owns it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from foveal.layers import cpu_fused, fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config) -> dict:
    """The rope dict of a transformers config (5.x `rope_parameters`, or 4.x `rope_theta`/`rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "mrope":  # Qwen2-VL 4.x configs: plain RoPE angles, split by mrope_section
        params["rope_type"] = "default"
    params.setdefault("rope_theta", 10000.0)
    return params


def inv_frequencies(config, head_dim: int) -> torch.Tensor:
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "linear":
        inv = inv / float(params["factor"])
    elif rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_ctx = float(params["original_max_position_embeddings"])
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = torch.where(medium, smoothed, scaled)
    elif rope_type == "yarn":
        inv = _yarn(inv, params, dim, base)
    return inv


def _yarn(inv: torch.Tensor, params: dict, dim: int, base: float) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), more than `beta_fast` times kept, a linear ramp between."""
    factor = float(params["factor"])
    old_ctx = float(params["original_max_position_embeddings"])

    def dim_of(rotations: float) -> float:  # the frequency index that turns `rotations` times
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(float(params.get("beta_fast") or 32)), dim_of(float(params.get("beta_slow") or 1))
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the extrapolated (unchanged) frequency
    return inv / factor * (1 - keep) + inv * keep


def attention_factor(config) -> float:
    """What cos and sin are multiplied by: YaRN's `attention_factor` (0.1 ln(factor) + 1 unless given,
    or the mscale ratio), 1 for other rope types."""
    params = rope_parameters(config)
    if params["rope_type"] != "yarn":
        return 1.0
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(params["factor"])
    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for positions [0, max_positions); `forward` rotates q and k in place of a copy."""

    def __init__(self, config, head_dim: int, max_positions: int):
        super().__init__()
        # computed on the CPU even inside build_model's meta-device construction: arithmetic on meta
        # tensors runs torch's Python references, whose first use imports torch._dynamo (~0.9 s)
        with torch.device("cpu"):
            inv = inv_frequencies(config, head_dim)
            pos = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(pos, inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            scale = attention_factor(config)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos/sin [T, 1, head_dim]; computed once per step and shared by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def mrope_axes(section: list[int], interleaved: bool) -> torch.Tensor:
    """The axis (0 t, 1 h, 2 w) that owns each of the sum(section) rotary frequencies.

    consecutive (Qwen2-VL), section [2, 3, 3]:  t t h h h w w w
    interleaved (Qwen3-VL), section [4, 2, 2]:  t h w t h w t t   (h, w stop after their 3*n first slots)
    """
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    j = torch.arange(sum(section))
    axis = torch.zeros_like(j)
    for a in (1, 2):
        axis[(j % 3 == a) & (j < 3 * section[a])] = a
    return axis


class MRotaryEmbedding(RotaryEmbedding):
    """M-RoPE: `cos_sin` takes [3, T] positions (1-D [T] positions mean the same position on every axis)."""

    def __init__(self, config, head_dim: int, max_positions: int, *, interleaved: bool = False):
        super().__init__(config, head_dim, max_positions)
        # transformers falls back to these splits of 128-dim heads when a config names none
        default = (24, 20, 20) if interleaved else (16, 24, 24)
        section = [int(x) for x in rope_parameters(config).get("mrope_section") or default]
        half = self.cos.shape[-1] // 2
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must sum to the {half} rotary frequencies")
        axis = mrope_axes(section, interleaved)
        # axis of every rotary dim (both halves), as a [1, head_dim] row for gathering
        self.register_buffer("axis", torch.cat((axis, axis)).unsqueeze(0), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        # idx[t, d] = the position of token t on the axis that owns rotary dim d
        idx = positions.t().gather(1, self.axis.expand(positions.shape[1], -1))
        cos = self.cos.gather(0, idx).to(dtype).unsqueeze(1)
        sin = self.sin.gather(0, idx).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotate-half convention (first half pairs with second half)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def apply_rotary_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norms=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary on q and k, after `norms` (q_norm, k_norm: RMSNorm modules over head_dim, Qwen3's)
    where given. On CUDA one fused kernel normalizes and rotates both IN PLACE (q and k may be views of
    the qkv buffer, which saves a pass); the CPU path returns new tensors as the modules and
    apply_rotary do."""
    if q.is_cuda and fused.use_fused(q):
        if norms is None:
            return fused.rotary_qk_(q, k, cos, sin)
        qn, kn = norms
        if qn.weight.dtype == kn.weight.dtype == q.dtype and qn.eps == kn.eps:
            return fused.rotary_qk_(q, k, cos, sin, (qn.weight, kn.weight, qn.eps))
    if norms is not None:
        q, k = norms[0](q), norms[1](k)
        if q.is_cuda and fused.use_fused(q):
            return fused.rotary_qk_(q, k, cos, sin)
    if cpu_fused.use(q) and (out := cpu_fused.rotary_qk(q, k, cos, sin)) is not None:
        return out
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
