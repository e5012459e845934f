"""Rotary position embedding (the Hugging Face "rotate half" layout).

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
    if kind == "proportional":  # Gemma 4: the head's first pairs rotate at the whole head's rates, the rest not
        num_rotated = int(float(scaling["partial_rotary_factor"]) * head_dim // 2)
        inv_freq[num_rotated:] = 0.0
        return inv_freq / float(scaling.get("factor", 1.0))
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported (supported: none, linear, llama3)")


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = inverse_frequencies(config)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        self.cos = angles.cos().to(device=device, dtype=dtype)
        self.sin = angles.sin().to(device=device, dtype=dtype)
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim] each, broadcast over heads; computed once per step.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        rotated = torch.cat([-x[..., self.half:], x[..., :self.half]], dim=-1)
        return x * cos + rotated * sin
