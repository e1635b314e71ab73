"""Rotary position embedding: the inverse frequencies of the default and llama3 variants, and their application."""
from __future__ import annotations

import math

import torch


def rope_settings(config: dict) -> tuple[float, dict | None]:
    """(theta, scaling or None for the default rope) from a Hugging Face config.json, whichever layout it uses:
    `rope_theta` and `rope_scaling`, or transformers v5's `rope_parameters` holding both."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)  # per layer type (Gemma 3): the full-attention layers'
    theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    return theta, rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None


def local_rope_settings(config: dict) -> tuple[float, dict | None] | None:
    """The sliding-window layers' own (theta, scaling) where they have one (Gemma 3), else None."""
    local = (config.get("rope_parameters") or {}).get("sliding_attention")
    if local is None:
        theta = config.get("rope_local_base_freq")
        return None if theta is None else (float(theta), None)
    return float(local.get("rope_theta", 10000.0)), local if local.get("rope_type", "default") != "default" else None


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)  # [head_dim // 2]
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "yarn":
        return yarn_inv_frequencies(head_dim, theta, scaling)
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: default, llama3, yarn)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def yarn_inv_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023; gpt-oss): each frequency between its original (extrapolated) and its value divided by
    `factor` (interpolated), by a linear ramp over the dimensions whose wavelengths fall between beta_fast and
    beta_slow rotations of the original context."""
    factor, context = scaling["factor"], scaling["original_max_position_embeddings"]
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def attention_factor(scaling: dict | None) -> float:
    """What YaRN multiplies cos and sin by (0.1 ln(factor) + 1, unless the config gives it); 1 for other ropes."""
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0


class Rope:
    """Precomputed cos/sin tables indexed by position. `sin` has its first half negated, so that rotating is
    x * cos + roll(x, head_dim / 2) * sin: the usual rotate_half with its negation folded into the table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float = 10000.0, scaling: dict | None = None):
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        factor = attention_factor(scaling)
        self.cos, self.sin = emb.cos() * factor, emb.sin() * factor
        self.sin[:, :head_dim // 2] *= -1

    def to(self, dtype: torch.dtype, device=None) -> "Rope":
        self.cos, self.sin = self.cos.to(device=device, dtype=dtype), self.sin.to(device=device, dtype=dtype)
        return self

    def tables(self, positions: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [..., 1, head_dim] for positions [...] of any shape, broadcasting over heads."""
        cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., heads, head_dim]; cos, sin from `Rope.tables`."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin
