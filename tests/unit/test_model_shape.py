"""model/shape.py: one description of a model file, the same one the loader, the planner, bench
compare and the server read. On the real files: SmolLM2 (Q4_1, Llama) and Gemma 3 270M (Q4_K_M,
sliding windows), their published shapes, the engine's ModelConfig made from them, and byte
counts that account for the file's tensor data.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import numpy as np
import pytest
from gguf import GGUFWriter, RopeScalingType

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.gguf_file import GGUFFile
from tokios.kv_cache.dtypes import kv_bytes_per_element
from tokios.model.shape import read_model_shape
from tokios.model_files import default_model_path, gemma3_model_path
from tokios.tools.plan import formulas
from tokios.tools.plan.model_presets import NAME_TO_PRESET, load_model_shape

# ModelConfig field -> the ModelShape field it is made from, where the names differ.
CONFIG_TO_SHAPE_FIELD = {"max_model_len": "max_context_len", "attention_bias": "has_qkv_bias"}


def gemma3_path():
    try:
        return gemma3_model_path()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


def loader_config(path):
    from tokios.model.loader import model_config_from_gguf

    return model_config_from_gguf(GGUFFile(path))


def assert_config_is_the_shape(config, shape):
    from tokios.config import ModelConfig

    for field in dataclasses.fields(ModelConfig):
        assert getattr(config, field.name) == getattr(shape, CONFIG_TO_SHAPE_FIELD.get(field.name, field.name)), \
            field.name


def test_smollm2_shape_is_the_published_one_and_the_loaders_config():
    path = default_model_path()
    shape = read_model_shape(path)
    assert (shape.architecture, shape.num_layers, shape.hidden_size, shape.intermediate_size) == ("llama", 30, 576, 1536)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (9, 3, 64, 49152)
    assert shape.tie_word_embeddings and not shape.has_qkv_bias and shape.layer_windows is None
    config = loader_config(path)
    assert_config_is_the_shape(config, shape)
    assert config.max_model_len == NAME_TO_PRESET["smollm2-135m"].max_context_len
    # Both KV formulas are the one in kv_cache/dtypes.py: the engine's, rounded, and the planner's.
    for dtype in ("bfloat16", "int8", "float32"):
        per_element = kv_bytes_per_element(dtype, shape.head_dim)
        assert config.kv_bytes_per_token(per_element) == round(formulas.kv_bytes_per_token(shape, per_element))
    assert config.kv_bytes_per_token(2.0) == 2 * 30 * 3 * 64 * 2


def test_gemma3_shape_has_its_windows_constants_and_block_types():
    path = gemma3_path()
    shape = read_model_shape(path)
    assert (shape.architecture, shape.num_layers, shape.hidden_size) == ("gemma3", 18, 640)
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.vocab_size) == (4, 1, 256, 262144)
    assert shape.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert shape.query_pre_attn_scalar == 256.0 and shape.rope_local_theta == 10000.0
    assert sorted(shape.block_type_to_num_bytes) == ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert_config_is_the_shape(loader_config(path), shape)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_byte_counts_are_the_files_tensor_data(which):
    path = default_model_path() if which == "smollm2" else gemma3_path()
    gguf = GGUFFile(path)
    shape = read_model_shape(path)
    assert sum(shape.block_type_to_num_bytes.values()) == shape.file_weight_bytes
    # The data section holds every tensor, each padded to the alignment at most.
    padding = len(gguf.tensors) * gguf.metadata.get("general.alignment", 32)
    assert shape.file_weight_bytes <= os.path.getsize(path) - gguf.data_offset <= shape.file_weight_bytes + padding
    embedding = gguf.tensors["token_embd.weight"].num_bytes
    expected_step = shape.file_weight_bytes - (0 if shape.tie_word_embeddings else embedding)
    assert shape.file_step_weight_bytes == expected_step
    assert load_model_shape(str(path)) == shape  # the planner's --model reads the same description


def test_any_architecture_has_a_shape_but_only_registered_ones_load(tmp_path):
    path = tmp_path / "foo.gguf"
    writer = GGUFWriter(str(path), arch="foo")
    for add, value in ((writer.add_block_count, 2), (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_context_length, 64)):
        add(value)
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shape = read_model_shape(path)
    assert (shape.architecture, shape.num_layers, shape.head_dim) == ("foo", 2, 4)
    assert shape.vocab_size == 16  # neither vocab_size nor a vocabulary: the embedding's rows
    assert shape.block_type_to_num_bytes == {"F32": 16 * 8 * 4}
    with pytest.raises(UnsupportedError, match="'foo'"):
        loader_config(path)


def test_hf_directory_shape_and_the_loaders_config(tmp_path):
    config = {"architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
              "max_position_embeddings": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6}
    (tmp_path / "config.json").write_text(json.dumps(config))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [100, 64], "data_offsets": [0, 0]},
                         "lm_head.weight": {"dtype": "F32", "shape": [100, 64], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    shape = read_model_shape(tmp_path)
    assert (shape.architecture, shape.has_qkv_bias, shape.max_context_len, shape.rope_theta) == ("qwen2", True, 512, 1e6)
    assert shape.block_type_to_num_bytes == {"BF16": 100 * 64 * 2, "F32": 100 * 64 * 4}
    assert shape.file_step_weight_bytes == 100 * 64 * 4  # untied: the embedding is gathered, not read

    from tokios.model.loader import model_config_from_hf

    assert_config_is_the_shape(model_config_from_hf(str(tmp_path)), shape)


def test_rope_bases_per_layer_type_are_described_and_refused_only_by_the_loader(tmp_path):
    config = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "vocab_size": 100,
              "rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = load_model_shape(str(tmp_path))
    assert shape.rope_theta is None and sorted(shape.rope_scaling) == ["full_attention", "sliding_attention"]

    from tokios.model.loader import model_config_from_hf

    with pytest.raises(UnsupportedError, match="rope_parameters without rope_theta"):
        model_config_from_hf(str(tmp_path))


def write_header_only(writer: GGUFWriter, path):
    """Finishes a header-only test file: one small embedding tensor, then everything written."""
    writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_yarn_gguf(path, **yarn_keys: float):
    writer = GGUFWriter(str(path), arch="qwen3")
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 8), (writer.add_feed_forward_length, 16),
                       (writer.add_head_count, 2), (writer.add_context_length, 256)):
        add(value)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(4.0)
    writer.add_rope_scaling_orig_ctx_len(64)
    for key, value in yarn_keys.items():
        writer.add_float32(f"qwen3.rope.scaling.{key}", value)
    return write_header_only(writer, path)


def test_a_yarn_gguf_gives_its_parameters_under_transformers_names(tmp_path):
    shape = read_model_shape(write_yarn_gguf(tmp_path / "yarn.gguf", yarn_beta_fast=8.0, yarn_beta_slow=0.5,
                                             yarn_attn_factor=1.25))
    assert shape.rope_scaling == {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                  "beta_fast": 8.0, "beta_slow": 0.5, "attention_factor": 1.25}
    assert read_model_shape(write_yarn_gguf(tmp_path / "plain.gguf", yarn_ext_factor=1.0)).rope_scaling == \
        {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    with pytest.raises(UnsupportedError, match="qwen3.rope.scaling.yarn_ext_factor 2.0 is not supported"):
        read_model_shape(write_yarn_gguf(tmp_path / "ext.gguf", yarn_ext_factor=2.0))
    with pytest.raises(UnsupportedError, match="qwen3.rope.scaling.yarn_log_multiplier is not supported"):
        read_model_shape(write_yarn_gguf(tmp_path / "log.gguf", yarn_log_multiplier=0.1))


def write_moe_gguf(path, arch: str, **routing_keys):
    """A header-only mixture of experts (8 experts, top 2) of `arch` with `routing_keys`
    (expert_gating_func, expert_weights_norm, expert_weights_scale) as llama.cpp names them."""
    writer = GGUFWriter(str(path), arch=arch)
    for add, value in ((writer.add_block_count, 1), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 16), (writer.add_head_count, 2),
                       (writer.add_context_length, 256), (writer.add_expert_count, 8),
                       (writer.add_expert_used_count, 2)):
        add(value)
    for key, value in routing_keys.items():
        (writer.add_bool if isinstance(value, bool) else writer.add_float32 if isinstance(value, float)
         else writer.add_uint32)(f"{arch}.{key}", value)
    return write_header_only(writer, path)


def test_an_moe_files_routing_is_its_keys_else_its_architectures_rule(tmp_path):
    def routing(shape):
        return shape.expert_scoring, shape.expert_normalize_top_k, shape.expert_weights_scale

    # llama.cpp's rules where the file is silent: Qwen3-MoE and Mixtral (llama) renormalise.
    assert routing(read_model_shape(write_moe_gguf(tmp_path / "a.gguf", "qwen3moe"))) == ("softmax", True, 1.0)
    assert routing(read_model_shape(write_moe_gguf(tmp_path / "b.gguf", "llama"))) == ("softmax", True, 1.0)
    assert routing(read_model_shape(write_moe_gguf(tmp_path / "c.gguf", "olmoe"))) == ("softmax", False, 1.0)
    stated = write_moe_gguf(tmp_path / "d.gguf", "qwen3moe", expert_gating_func=2, expert_weights_norm=False,
                            expert_weights_scale=2.5)
    assert routing(read_model_shape(stated)) == ("sigmoid", False, 2.5)
    # llama.cpp's scale 0 is no scale
    assert routing(read_model_shape(write_moe_gguf(tmp_path / "e.gguf", "olmoe", expert_weights_scale=0.0,
                                                   expert_gating_func=3))) == ("top_k_softmax", False, 1.0)
    with pytest.raises(UnsupportedError, match="qwen3moe.expert_gating_func 4 is not supported"):
        read_model_shape(write_moe_gguf(tmp_path / "f.gguf", "qwen3moe", expert_gating_func=4))
