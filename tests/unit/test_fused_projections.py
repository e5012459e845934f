"""Row surgery on weights at load, packed or dense alike: Phi-3's fused qkv_proj and gate_up_proj
split into Llama's projections (model/phi3.py), and partial rotary's reordering of each query and
key head (model/rope.py pair_unrotated_dimensions). A packed weight moves whole rows of blocks, so
its dequantized result is exactly the dense weight's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError
from tokios.model.blocks import quantize
from tokios.model.phi3 import split_fused_projections
from tokios.model.quant import PackedWeight, as_dense
from tokios.model.rope import pair_unrotated_dimensions

CONFIG = ModelConfig(architecture="phi3", num_layers=1, hidden_size=32, intermediate_size=16, num_heads=4,
                     num_kv_heads=2, head_dim=8, vocab_size=10, max_model_len=64, num_rope_dims=6)
QKV_ROWS = (4 + 2 * 2) * 8


def _packed(rows: int, seed: int) -> PackedWeight:
    weight = np.random.default_rng(seed).standard_normal((rows, 32)).astype(np.float32)
    return PackedWeight.from_file(quantize(weight, T.Q8_0), T.Q8_0, (rows, 32), "test")


def _fused_weights() -> dict:
    return {"model.layers.0.self_attn.qkv_proj.weight": _packed(QKV_ROWS, 0),
            "model.layers.0.mlp.gate_up_proj.weight": _packed(2 * 16, 1)}


def test_packed_and_dense_weights_split_and_reorder_alike():
    packed = pair_unrotated_dimensions(split_fused_projections(_fused_weights(), CONFIG), CONFIG)
    dense = pair_unrotated_dimensions(split_fused_projections(
        {name: as_dense(weight) for name, weight in _fused_weights().items()}, CONFIG), CONFIG)
    assert sorted(packed) == sorted(dense) == sorted(f"model.layers.0.{name}.weight" for name in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"))
    for name, weight in packed.items():
        assert isinstance(weight, PackedWeight), name
        assert torch.equal(as_dense(weight), dense[name]), name


def test_fused_rows_go_to_q_k_v_and_gate_up_in_order():
    qkv = torch.arange(QKV_ROWS, dtype=torch.float32)[:, None].expand(-1, 32)
    gate_up = torch.arange(32, dtype=torch.float32)[:, None].expand(-1, 32)
    config = ModelConfig(**{**CONFIG.__dict__, "num_rope_dims": None})
    split = split_fused_projections({"model.layers.0.self_attn.qkv_proj.weight": qkv,
                                     "model.layers.0.mlp.gate_up_proj.weight": gate_up}, config)
    first_rows = {name.split(".")[-2]: int(weight[0, 0]) for name, weight in split.items()}
    assert first_rows == {"q_proj": 0, "k_proj": 32, "v_proj": 48, "gate_proj": 0, "up_proj": 16}


def test_partial_rotary_pairs_the_unrotated_dimensions_of_each_query_and_key_head():
    rows = torch.arange(4 * 8, dtype=torch.float32)[:, None]
    reordered = pair_unrotated_dimensions({"q_proj.weight": rows, "v_proj.weight": rows}, CONFIG)
    # head_dim 8, 6 rotated: [rotated 0-2, unrotated 6, rotated 3-5, unrotated 7] in every head
    assert reordered["q_proj.weight"][:16, 0].tolist() == [0, 1, 2, 6, 3, 4, 5, 7, 8, 9, 10, 14, 11, 12, 13, 15]
    assert torch.equal(reordered["v_proj.weight"], rows)


def test_fused_weight_of_the_wrong_height_is_a_load_error():
    with pytest.raises(ModelLoadError, match="qkv_proj.weight has 72 rows; .* make 64"):
        split_fused_projections({"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(72, 32)}, CONFIG)
