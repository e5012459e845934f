"""model/expert_weights.py: every layout a checkpoint stores its experts in comes out as the one
stacked layout make_sparse_moe reads, exactly; a missing expert or a fused tensor of another
width is an error naming it. (The converted GGUF files and transformers' save_pretrained
directories are tests/model/test_families.py's and test_moe_families.py's.)"""

from __future__ import annotations

import pytest
import torch

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError
from tokios.model.expert_weights import gather_expert_weights

NUM_EXPERTS, INTERMEDIATE, HIDDEN = 4, 3, 5
CONFIG = ModelConfig(architecture="qwen3moe", num_layers=1, hidden_size=HIDDEN, intermediate_size=7, num_heads=1,
                     num_kv_heads=1, head_dim=HIDDEN, vocab_size=11, max_model_len=16, num_experts=NUM_EXPERTS,
                     num_experts_per_token=2, expert_intermediate_size=INTERMEDIATE)
PREFIX = "model.layers.0"


def _stacked(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"gate_proj": torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=generator),
            "up_proj": torch.randn(NUM_EXPERTS, INTERMEDIATE, HIDDEN, generator=generator),
            "down_proj": torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator)}


def _assert_gathered(gathered: dict, expected: dict[str, torch.Tensor], router: torch.Tensor) -> None:
    assert sorted(gathered) == sorted([f"{PREFIX}.mlp.experts.{p}.weight" for p in expected]
                                      + [f"{PREFIX}.mlp.gate.weight", "model.norm.weight"])
    for projection, tensor in expected.items():
        assert torch.equal(gathered[f"{PREFIX}.mlp.experts.{projection}.weight"], tensor), projection
    assert torch.equal(gathered[f"{PREFIX}.mlp.gate.weight"], router)


def test_per_expert_tensors_are_stacked_in_expert_order():
    experts, router = _stacked(0), torch.randn(NUM_EXPERTS, HIDDEN)
    weights = {f"{PREFIX}.mlp.experts.{e}.{p}.weight": experts[p][e] for p in experts for e in reversed(range(4))}
    weights |= {f"{PREFIX}.mlp.gate.weight": router, "model.norm.weight": torch.ones(HIDDEN)}
    _assert_gathered(gather_expert_weights(weights, CONFIG), experts, router)


def test_mixtrals_w1_w2_w3_are_gate_down_up():
    experts, router = _stacked(1), torch.randn(NUM_EXPERTS, HIDDEN)
    names = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
    weights = {f"{PREFIX}.block_sparse_moe.experts.{e}.{w}.weight": experts[p][e] for w, p in names.items()
               for e in range(NUM_EXPERTS)}
    weights |= {f"{PREFIX}.block_sparse_moe.gate.weight": router, "model.norm.weight": torch.ones(HIDDEN)}
    _assert_gathered(gather_expert_weights(weights, CONFIG), experts, router)


@pytest.mark.parametrize("suffix", ["", ".weight"])
def test_a_fused_gate_up_is_each_experts_gate_rows_then_its_up_rows(suffix):
    # transformers 5's in-memory names (no suffix) and the GGUF merged tensor's loader name
    experts, router = _stacked(2), torch.randn(NUM_EXPERTS, HIDDEN)
    weights = {f"{PREFIX}.mlp.experts.gate_up_proj{suffix}": torch.cat([experts["gate_proj"], experts["up_proj"]], 1),
               f"{PREFIX}.mlp.experts.down_proj{suffix}": experts["down_proj"],
               f"{PREFIX}.mlp.gate.weight": router, "model.norm.weight": torch.ones(HIDDEN)}
    _assert_gathered(gather_expert_weights(weights, CONFIG), experts, router)


def test_a_missing_expert_or_a_fused_tensor_of_another_width_is_named():
    experts = _stacked(3)
    weights = {f"{PREFIX}.mlp.experts.{e}.{p}.weight": experts[p][e] for p in experts for e in range(3)}
    with pytest.raises(ModelLoadError, match=r"model.layers.0: \w+ of experts \[3\] missing"):
        gather_expert_weights(weights, CONFIG)
    too_wide = {f"{PREFIX}.mlp.experts.gate_up_proj": torch.zeros(NUM_EXPERTS, 2 * INTERMEDIATE + 2, HIDDEN)}
    with pytest.raises(ModelLoadError, match=r"gate_up_proj has shape \[4, 8, 5\]; the config's .* \[4, 6, 5\]"):
        gather_expert_weights(too_wide, CONFIG)


def test_a_dense_models_weights_pass_unchanged():
    weights = {"model.layers.0.mlp.gate_proj.weight": torch.zeros(2, 2)}
    assert gather_expert_weights(weights, ModelConfig("llama", 1, 2, 2, 1, 1, 2, 3, 4)) is weights
