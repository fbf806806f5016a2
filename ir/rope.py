"""Rotary position embedding: inverse frequencies per RoPE type and the rotation itself.

The frequency formulas follow each family's published definition (Llama 3 "llama3" scaling,
YaRN as used by DeepSeek-V3); they are checked against Hugging Face transformers in tests.
"""

from __future__ import annotations

import math

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """Per-pair inverse frequencies (float64, length dim/2) and the cos/sin scale factor."""
    base = float(rope["theta"])
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    kind = rope["rope_type"]
    if kind == "default":
        return inv, 1.0
    if kind == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        lo_wavelen, hi_wavelen = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
        return torch.where(mid, smoothed, scaled), 1.0
    if kind == "yarn":
        factor, old = rope["factor"], rope["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
        high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp
        inv = (inv / factor) * (1 - extrapolation) + inv * extrapolation
        if rope["mscale"] and rope["mscale_all_dim"]:  # both given, as transformers requires
            att = yarn_mscale(factor, rope["mscale"]) / yarn_mscale(factor, rope["mscale_all_dim"])
        else:
            att = yarn_mscale(factor)
        return inv, att
    raise ValueError(f"unknown rope_type {kind!r}")


def cos_sin(rope: dict, dim: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [T, dim/2] (float64) for integer positions [T]."""
    inv, att = inv_freq_and_attention_factor(rope, dim)
    ang = positions.to(torch.float64)[:, None] * inv.to(positions.device)[None, :]
    return ang.cos() * att, ang.sin() * att


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> torch.Tensor:
    """Rotate x [T, H, dim] by per-token cos/sin [T, dim/2]."""
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, b * c + a * s), dim=-1)
