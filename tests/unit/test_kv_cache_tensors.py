"""The KV cache's tensors (model/attention.py allocate_kv_caches) and the bytes a block id
holds (kv_block_bytes), for layers of different head shapes and layers reading another's K/V."""

from __future__ import annotations

import torch

from tokios.config import ModelConfig
from tokios.model.attention import allocate_kv_caches, distinct_cache_pairs, kv_block_bytes


def gemma4_like_config(**fields) -> ModelConfig:
    # Layers 0, 2 slide (2 KV heads of 16), 1, 3 attend fully (1 KV head of 32); 4 and 5 read
    # the K/V of 2 and 3.
    return ModelConfig(architecture="gemma4", num_layers=6, hidden_size=64, intermediate_size=96, num_heads=4,
                       num_kv_heads=2, head_dim=32, vocab_size=100, max_model_len=64,
                       layer_windows=(8, None) * 3, layer_kv_shapes=((2, 16), (1, 32)) * 3,
                       kv_source_layers=(0, 1, 2, 3, 2, 3), **fields)


def test_each_layer_sees_its_own_head_shape_and_readers_share_their_source():
    config = gemma4_like_config()
    caches = allocate_kv_caches(config, 10, torch.float32, torch.device("cpu"))
    assert [tuple(key.shape) for key, _ in caches] == [(10, 2, 16), (10, 1, 32)] * 3
    assert caches[4] is caches[2] and caches[5] is caches[3]
    # Groups (full: 1, 3; sliding: 0, 2) share tensor pairs by position: 2 pairs of 32 values a slot.
    assert [tuple(key.shape) for key, _ in distinct_cache_pairs(caches)] == [(10, 32), (10, 32)]
    caches[0][0][3] = 1.0
    assert caches[1][0][3].sum() == 32.0  # one slot, seen by layer 0 and layer 1 (of another group)


def test_a_block_holds_what_is_allocated_for_it():
    config = gemma4_like_config()
    caches = allocate_kv_caches(config, 4 * 16, torch.float32, torch.device("cpu"))
    allocated = sum(t.numel() * t.element_size() for pair in distinct_cache_pairs(caches) for t in pair)
    assert kv_block_bytes(config, torch.float32, 16) * 4 == allocated == 2 * 2 * 32 * 4 * 64
    # int8 keeps a float32 scale per head: 2 x 20 bytes a sliding slot, 1 x 36 a full one.
    assert kv_block_bytes(config, torch.int8, 16) == 2 * (40 + 40) * 16
    # Every layer's K/V for a token, counted once per storing layer (4 of the 6).
    assert config.kv_bytes_per_token(4) == 2 * 4 * (2 * 16 + 32 + 2 * 16 + 32)


def test_a_uniform_model_keeps_one_contiguous_pair_per_tensor():
    config = ModelConfig(architecture="llama", num_layers=3, hidden_size=64, intermediate_size=96, num_heads=4,
                         num_kv_heads=2, head_dim=16, vocab_size=100, max_model_len=64)
    caches = allocate_kv_caches(config, 8, torch.bfloat16, torch.device("cpu"))
    assert all(key.is_contiguous() and key.shape == (8, 2, 16) for key, _ in caches)
    assert len(distinct_cache_pairs(caches)) == 3
    assert kv_block_bytes(config, torch.bfloat16, 16) == config.kv_bytes_per_token(2) * 16
