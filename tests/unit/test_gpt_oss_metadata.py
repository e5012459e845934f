"""What a gpt-oss file says beyond the Llama shape (model/gpt_oss_metadata.py): which layers
slide, from GGUF metadata (llama.cpp's period 2 when the file has no pattern) and from a
config.json's layer_types, and the variants refused by name."""

from __future__ import annotations

import pytest

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.gpt_oss_metadata import gpt_oss_fields, gpt_oss_hf_fields


def test_gguf_without_a_pattern_slides_on_even_layers():
    fields = gpt_oss_fields({"gpt-oss.attention.sliding_window": 128}, "f.gguf", 4)
    assert fields == {"layer_windows": (128, None, 128, None)}


def test_gguf_pattern_flags_per_layer_are_read():
    metadata = {"gpt-oss.attention.sliding_window": 8, "gpt-oss.attention.sliding_window_pattern": [False, True, True]}
    assert gpt_oss_fields(metadata, "f.gguf", 3)["layer_windows"] == (None, 8, 8)


def test_gguf_without_a_window_or_with_a_sliding_rope_base_of_its_own_is_refused():
    with pytest.raises(ModelLoadError, match="sliding_window"):
        gpt_oss_fields({}, "f.gguf", 2)
    metadata = {"gpt-oss.attention.sliding_window": 8, "gpt-oss.rope.freq_base": 150000.0,
                "gpt-oss.rope.freq_base_swa": 10000.0}
    with pytest.raises(UnsupportedError, match="freq_base_swa"):
        gpt_oss_fields(metadata, "f.gguf", 2)


HF = {"num_hidden_layers": 3, "sliding_window": 16,
      "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


def test_hf_layer_types_give_the_windows():
    assert gpt_oss_hf_fields(HF, "config.json") == {"layer_windows": (16, None, 16)}


@pytest.mark.parametrize(("change", "message"), [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4 checkpoint directory is not supported; convert"),
    ({"swiglu_limit": 8.0}, "swiglu_limit 8.0"),
    ({"swiglu_alpha": 1.0}, "swiglu_alpha 1.0"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "chunked_attention"),
])
def test_hf_variants_the_engine_does_not_run_are_refused_by_name(change, message):
    with pytest.raises(UnsupportedError, match=message):
        gpt_oss_hf_fields({**HF, **change}, "config.json")


def test_hf_layer_types_must_cover_every_layer():
    with pytest.raises(ModelLoadError, match="layer_types"):
        gpt_oss_hf_fields({**HF, "layer_types": ["full_attention"]}, "config.json")
