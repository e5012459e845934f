"""Rotary position embedding (the Hugging Face "rotate half" layout), and the RoPE scalings a
file may declare: linear, Llama 3 (or its `rope_freqs` divisors), YaRN.

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
    if kind == "yarn":
        return yarn_inverse_frequencies(inv_freq, config)
    raise UnsupportedError(f"RoPE scaling type {kind!r} is not supported "
                           "(supported: none, linear, llama3, longrope, proportional, yarn)")


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


def attention_factor(config: ModelConfig) -> float:
    """What the scaling multiplies cos and sin by (so every attention logit by its square):
    LongRoPE's attention factor, YaRN's, or 1."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind in ("longrope", "su"):
        return float(scaling["attention_factor"])
    if kind == "yarn":
        return yarn_attention_factor(config)
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
    num_dims, base = 2 * inv_freq.numel(), config.rope_theta  # the rotated dimensions

    def dimension_turning(num_turns: float) -> float:
        # The dimension index whose wavelength fits num_turns times into the original context.
        return num_dims * math.log(original_len / (num_turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, num_dims - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(num_dims // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
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
        # Partial rotary: the pairs past the rotated ones (pair_unrotated_dimensions) turn by
        # angle 0 and are not scaled, so they pass unchanged.
        num_unrotated_pairs = config.head_dim // 2 - inv_freq.numel()
        pair_scale = torch.cat([torch.full_like(inv_freq, attention_factor(config)),
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
