"""config.json of a Hugging Face directory -> ModelConfig, in both schemas transformers writes."""

import json

import pytest

from tokios.errors import UnsupportedError
from tokios.model.loader import model_config_from_hf

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_attention_heads": 8,
         "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_key_value_heads": 2,
         "vocab_size": 100}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def config_of(tmp_path, **fields):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, **fields}))
    return model_config_from_hf(str(tmp_path))


def test_rope_base_and_scaling_read_from_either_schema(tmp_path):
    before_5 = config_of(tmp_path, rope_theta=500000.0, rope_scaling=LLAMA3_SCALING)
    from_5 = config_of(tmp_path, rope_parameters={"rope_theta": 500000.0, **LLAMA3_SCALING})
    assert before_5.rope_theta == from_5.rope_theta == 500000.0
    assert before_5.rope_scaling == from_5.rope_scaling == LLAMA3_SCALING
    plain = config_of(tmp_path, rope_parameters={"rope_theta": 100000.0, "rope_type": "default"})
    assert plain.rope_theta == 100000.0 and plain.rope_scaling is None
    assert config_of(tmp_path).rope_theta == 10000.0  # neither key: the Llama default


def test_rope_parameters_per_layer_type_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedError, match="rope_parameters without rope_theta.*full_attention"):
        config_of(tmp_path, rope_parameters={"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}})
