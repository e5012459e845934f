"""config.json of a Hugging Face directory -> ModelConfig, in both schemas transformers writes."""

import json

import pytest
import torch

from tokios.errors import ModelLoadError, UnsupportedError
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


PHI3 = {**LLAMA, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096}
SHORT, LONG = [1.0, 1.5, 2.0, 2.5], [1.0, 4.0, 16.0, 32.0]  # head_dim 8: four rotated pairs


def test_longrope_read_from_either_schema_with_transformers_attention_factor(tmp_path):
    """Phi-3.5's config.json (rope_scaling type longrope, or the older "su"; the original context
    at the top level) and transformers 5's (rope_parameters holding it): the same scaling, with
    the attention factor transformers derives, sqrt(1 + ln(131072 / 4096) / ln 4096)."""
    expected = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                "original_max_position_embeddings": 4096, "attention_factor": pytest.approx((1 + 5 / 12) ** 0.5)}
    for scaling in ({"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
                    {"type": "su", "short_factor": SHORT, "long_factor": LONG}):
        (tmp_path / "config.json").write_text(json.dumps({**PHI3, "rope_scaling": scaling}))
        assert model_config_from_hf(str(tmp_path)).rope_scaling == expected
    parameters = {"rope_theta": 10000.0, "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                  "original_max_position_embeddings": 4096, "partial_rotary_factor": 1.0}
    (tmp_path / "config.json").write_text(json.dumps({**PHI3, "rope_parameters": parameters}))
    config = model_config_from_hf(str(tmp_path))
    assert config.rope_scaling == expected and config.num_rope_dims is None


def test_longrope_attention_factor_or_factor_given_by_the_config_wins(tmp_path):
    scaling = {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}
    assert config_of(tmp_path, **{**PHI3, "rope_scaling": {**scaling, "attention_factor": 1.5}}
                     ).rope_scaling["attention_factor"] == 1.5
    assert config_of(tmp_path, **{**PHI3, "rope_scaling": {**scaling, "factor": 1.0}}
                     ).rope_scaling["attention_factor"] == 1.0


def test_partial_rotary_factor_read_from_the_top_level_or_rope_parameters(tmp_path):
    assert config_of(tmp_path, partial_rotary_factor=0.75).num_rope_dims == 6
    assert config_of(tmp_path, rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}).num_rope_dims == 4
    with pytest.raises(ModelLoadError, match="RoPE on 7 of each head's 8"):
        config_of(tmp_path, partial_rotary_factor=0.875)


def test_unknown_rope_scaling_is_refused_by_name(tmp_path):
    from tokios.model.rope import RotaryEmbedding

    config = config_of(tmp_path, rope_scaling={"rope_type": "quadratic", "factor": 2.0})
    with pytest.raises(UnsupportedError, match="'quadratic'"):
        RotaryEmbedding(config, 16, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_a_qwen_sliding_window_is_refused_by_name(tmp_path, model_type):
    assert config_of(tmp_path, model_type=model_type, use_sliding_window=False).architecture == model_type
    with pytest.raises(UnsupportedError, match="use_sliding_window"):
        config_of(tmp_path, model_type=model_type, use_sliding_window=True, sliding_window=4096)
