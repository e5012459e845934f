"""Rotary position embedding (the Hugging Face "rotate half" layout), and the RoPE scalings a
file may declare: linear, Llama 3 (or its `rope_freqs` divisors), YaRN.

GGUF files store Q/K weights permuted for llama.cpp's interleaved rotation; the GGUF loader
undoes that permutation, so every model here uses this one layout.
"""

from __future__ import annotations

import math

import torch

from tokios.config import ModelConfig
from tokios.errors import UnsupportedError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    head_dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("type", scaling.get("rope_type", "none"))
    if kind in ("none", "default", None):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        original_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = original_len / low_freq_factor
        high_freq_wavelen = original_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        middle = (wavelen <= low_freq_wavelen) & (wavelen >= high_freq_wavelen)
        return torch.where(middle, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: per-dimension divisors
        return inv_freq / scaling["factors"].to(torch.float64)
    if kind == "yarn":
        return yarn_inverse_frequencies(inv_freq, config)
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported (supported: none, linear, llama3, yarn)")


def attention_factor(config: ModelConfig) -> float:
    """What the scaling multiplies cos and sin by (so every attention logit by its square): 1
    unless the scaling says otherwise."""
    scaling = config.rope_scaling or {}
    if scaling.get("type", scaling.get("rope_type")) == "yarn":
        return yarn_attention_factor(config)
    return 1.0


def _yarn_factor(config: ModelConfig) -> float:
    scaling = config.rope_scaling
    factor = scaling.get("factor")
    # transformers: a YaRN without a factor stretches the original context to the configured one.
    return float(factor) if factor is not None else config.max_model_len / scaling["original_max_position_embeddings"]


def yarn_inverse_frequencies(inv_freq: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """YaRN (Qwen3, Qwen2.5): dimensions that turn more than beta_fast times over the original
    context keep their frequency, those that turn less than beta_slow times are divided by the
    factor, and a linear ramp over dimension indices blends the two in between."""
    scaling = config.rope_scaling
    factor = _yarn_factor(config)
    original_len = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    head_dim, base = config.head_dim, config.rope_theta

    def dimension_turning(num_turns: float) -> float:
        # The dimension index whose wavelength fits num_turns times into the original context.
        return head_dim * math.log(original_len / (num_turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(config: ModelConfig) -> float:
    """YaRN's attention temperature (transformers' attention_factor, the paper's mscale): the
    file's own when it gives one, else 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim
    ratio when both are given)."""
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(config)

    def mscale(weight: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = inverse_frequencies(config)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        factor = attention_factor(config)
        self.cos = (angles.cos() * factor).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * factor).to(device=device, dtype=dtype)
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim] each, broadcast over heads; computed once per step.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        rotated = torch.cat([-x[..., self.half:], x[..., :self.half]], dim=-1)
        return x * cos + rotated * sin
