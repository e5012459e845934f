"""Rotary position embedding (the Hugging Face "rotate half" layout).

GGUF files store Q/K weights permuted for llama.cpp's interleaved rotation; the GGUF loader
undoes that permutation, so every model here uses this one layout.

Whatever scaling the file declares is applied (config.rope_scaling, filled by model/shape.py and
model/loader.py); an unknown one is an UnsupportedError naming it.

LongRoPE (Phi-3 "su"/"longrope") has two tables of per-frequency divisors, short_factor and
long_factor, and an attention factor (mscale) that multiplies cos and sin, so every query-key
product by its square; it applies on every position, whichever table is in use. Which table:
- transformers picks by the positions of one forward pass: long when the highest position + 1
  exceeds original_max_position_embeddings, short otherwise; its generate() drops the cache and
  recomputes every key when a sequence crosses that boundary.
- llama.cpp picks once per context: long when the context per sequence (n_ctx_seq) exceeds
  original_max_position_embeddings, short otherwise, for every position of every sequence.
- tokios picks as llama.cpp does, by the engine's context per sequence (config.max_model_len,
  which the loader sets to the engine's max_model_len): the paged cache keeps keys rotated
  once, and prefix blocks are shared across requests, so one table must hold for every position
  of every sequence the engine serves. Within its context the engine then equals transformers'
  one full pass whenever the two agree on the table: a context at most
  original_max_position_embeddings (short table; every sequence fits below the boundary), or a
  sequence longer than original_max_position_embeddings in a longer context (long table). A
  shorter sequence in a longer context gets the long table, where transformers would use short.
"""

from __future__ import annotations

import math

import torch

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.quant import select_rows


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[num_rope_dims / 2] the rotated pairs' frequencies, scaled as the file declares."""
    num_dims = config.num_rope_dims or config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, num_dims, 2, dtype=torch.float64) / num_dims))
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
    if kind in ("longrope", "su"):
        return longrope_inverse_frequencies(inv_freq, scaling, config.max_model_len)
    if kind == "freq_factors":  # llama.cpp's rope_freqs tensor: per-dimension divisors
        return inv_freq / scaling["factors"].to(torch.float64)
    if kind == "proportional":  # Gemma 4: the head's first pairs rotate at the whole head's rates, the rest not
        num_rotated = int(float(scaling["partial_rotary_factor"]) * config.head_dim // 2)
        inv_freq[num_rotated:] = 0.0
        return inv_freq / float(scaling.get("factor", 1.0))
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported "
                           "(supported: none, linear, llama3, longrope, proportional)")


def longrope_inverse_frequencies(inv_freq: torch.Tensor, scaling: dict, context_len: int) -> torch.Tensor:
    """LongRoPE's frequencies for an engine serving sequences of up to `context_len` tokens: the
    long table when that context exceeds original_max_position_embeddings, else the short one
    (the module docstring says why the choice is per context)."""
    is_long = context_len > int(scaling["original_max_position_embeddings"])
    factors = torch.as_tensor(scaling["long_factor" if is_long else "short_factor"], dtype=torch.float64)
    if factors.shape != inv_freq.shape:
        raise ModelLoadError(f"LongRoPE {'long' if is_long else 'short'}_factor has {factors.numel()} values; "
                             f"a head of {2 * inv_freq.numel()} rotary dimensions needs {inv_freq.numel()}")
    return inv_freq / factors


def rotation_scale(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by (LongRoPE's attention factor; 1 otherwise)."""
    scaling = config.rope_scaling or {}
    if scaling.get("type", scaling.get("rope_type")) in ("longrope", "su"):
        return float(scaling["attention_factor"])
    return 1.0


def pair_unrotated_dimensions(weights: dict, config: ModelConfig) -> dict:
    """Partial rotary (num_rope_dims < head_dim: the file rotates each head's leading
    num_rope_dims dimensions, first half against second, and passes the rest) in this module's
    one full-head layout: every query and key head's rows reordered to [rotated first half,
    unrotated first half, rotated second half, unrotated second half], so the rotated pairs keep
    their partners and the unrotated dimensions pair among themselves, turned by angle 0
    (RotaryEmbedding). Scores q.k are unchanged by reordering both alike; the values keep their
    order. `weights` in Hugging Face names (whatever file they came from); other weights unchanged."""
    num_rotated = config.num_rope_dims
    if num_rotated is None:
        return weights
    head_dim, half = config.head_dim, config.num_rope_dims // 2
    num_unrotated_half = (head_dim - num_rotated) // 2
    order = torch.cat([torch.arange(half), num_rotated + torch.arange(num_unrotated_half),
                       half + torch.arange(half), num_rotated + num_unrotated_half + torch.arange(num_unrotated_half)])
    reordered = dict(weights)
    for name, weight in weights.items():
        if name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            num_heads = weight.shape[0] // head_dim
            rows = (torch.arange(num_heads)[:, None] * head_dim + order[None, :]).reshape(-1)
            reordered[name] = select_rows(weight, rows)
    return reordered


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype):
        inv_freq = inverse_frequencies(config)
        # Partial rotary: the pairs past the rotated ones (pair_unrotated_dimensions) turn by
        # angle 0 and are not scaled, so they pass unchanged.
        num_unrotated_pairs = config.head_dim // 2 - inv_freq.numel()
        pair_scale = torch.cat([torch.full_like(inv_freq, rotation_scale(config)),
                                torch.ones(num_unrotated_pairs, dtype=torch.float64)])
        inv_freq = torch.cat([inv_freq, torch.zeros(num_unrotated_pairs, dtype=torch.float64)])
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [max_positions, head_dim]
        scale = torch.cat([pair_scale, pair_scale])  # [head_dim]
        self.cos = (angles.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (angles.sin() * scale).to(device=device, dtype=dtype)
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim] each, broadcast over heads; computed once per step.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        rotated = torch.cat([-x[..., self.half:], x[..., :self.half]], dim=-1)
        return x * cos + rotated * sin
