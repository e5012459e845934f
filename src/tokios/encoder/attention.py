"""Attention over a packed EncoderBatch: each input attends only to itself.

Every group of inputs (batch.py) is gathered into a padded [inputs, heads, max_len, head_dim]
block for one scaled_dot_product_attention call and scattered back, so the padding costs only
attention, never the matrix products. Bidirectional by default; `causal` for a decoder read as
an encoder (last-token pooling), `window` for sliding-window layers (both directions when
bidirectional). `rotary_embedding` makes the RoPE tables of an encoder with rotary positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokios.config import ModelConfig
from tokios.encoder.batch import EncoderBatch
from tokios.model.rope import RotaryEmbedding


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: EncoderBatch, *,
                     scale: float | None = None, causal: bool = False, window: int | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim], key/value [num_tokens, num_kv_heads, head_dim]
    -> [num_tokens, num_heads * head_dim]."""
    num_tokens, num_heads, head_dim = query.shape
    is_gqa = key.shape[1] != num_heads
    out = query.new_empty((num_tokens, num_heads * head_dim))
    for group in batch.groups:
        # Padding slots gather row 0: the mask hides them as keys, and their query rows are dropped.
        gather = group.gather_index
        # [inputs, max_len, heads, head_dim] -> [inputs, heads, max_len, head_dim]
        q, k, v = (tensor[gather].transpose(1, 2) for tensor in (query, key, value))
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask(causal, window), scale=scale,
                                                  enable_gqa=is_gqa)
        flat = attended.transpose(1, 2).reshape(-1, num_heads * head_dim)  # [inputs * max_len, heads * head_dim]
        out.index_copy_(0, group.token_rows, flat.index_select(0, group.valid_slots))
    return out


def rotary_embedding(head_dim: int, theta: float, max_positions: int, device: torch.device) -> RotaryEmbedding:
    """Unscaled RoPE over whole heads, in model/rope.py's "rotate half" layout (the one llama.cpp's
    NEOX rotation and transformers use; the encoders' converters leave Q/K unpermuted)."""
    shape = ModelConfig(architecture="", num_layers=0, hidden_size=head_dim, intermediate_size=0, num_heads=1,
                        num_kv_heads=1, head_dim=head_dim, vocab_size=0, max_model_len=max_positions, rope_theta=theta)
    return RotaryEmbedding(shape, max_positions, device, torch.float32)
