"""One set of sampling defaults for every door (tokios/sampling_defaults.py): the precedence of a
flag over the model file over Tokios' set, what a GGUF file and a model directory declare, the
commands' flags, and the dialects' requests that leave fields unset."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import gguf
import pytest

from tokios import sampling_defaults
from tokios.errors import InvalidRequestError
from tokios.model_files import llama_cpp_sources
from tokios.sampling_params import SamplingParams

LLAMA_CPP_SET = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.0}


def _gguf_with(path, **sampling) -> str:
    """A GGUF file holding only metadata: the keys llama.cpp's converter writes."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in sampling.items():
        if isinstance(value, int):
            writer.add_uint32(f"general.sampling.{key}", value)
        else:
            writer.add_float32(f"general.sampling.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sampling_defaults.add_arguments(parser, applies_to="the test")
    return parser.parse_args(list(argv))


def test_tokios_set_is_llama_cpps_and_every_source_is_named():
    defaults = sampling_defaults.for_model(None)
    assert dict(defaults.field_to_value) == LLAMA_CPP_SET
    assert defaults.card() == {**LLAMA_CPP_SET, "source": {name: "tokios" for name in LLAMA_CPP_SET}}


def test_a_gguf_files_recommendation_is_read_field_by_field(tmp_path):
    path = _gguf_with(tmp_path / "m.gguf", temp=0.6, top_k=20, top_p=0.9, penalty_repeat=1.05)
    defaults = sampling_defaults.for_model(path)
    # Stored as float32, shown as written (not 0.6000000238418579).
    assert dict(defaults.field_to_value) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                             "repetition_penalty": 1.05}
    assert defaults.field_to_source == {"temperature": "model", "top_p": "model", "top_k": "model",
                                        "min_p": "tokios", "repetition_penalty": "model"}
    assert isinstance(defaults.field_to_value["top_k"], int)
    # --sampling-defaults tokios ignores the file; a flag beats both.
    assert dict(sampling_defaults.from_args(_parsed("--sampling-defaults", "tokios"), path).field_to_value) == LLAMA_CPP_SET
    flagged = sampling_defaults.from_args(_parsed("--top-k", "5", "--temperature", "0"), path)
    assert flagged.field_to_value["top_k"] == 5 and flagged.field_to_value["temperature"] == 0.0
    assert flagged.field_to_source["top_k"] == flagged.field_to_source["temperature"] == "flag"
    assert flagged.field_to_value["top_p"] == pytest.approx(0.9)


def test_a_directorys_generation_config_is_read_and_a_bad_value_is_dropped_with_a_warning(tmp_path, caplog):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 1.5, "top_k": 20, "bos_token_id": 1}))
    defaults = sampling_defaults.for_model(tmp_path)
    assert defaults.field_to_value["temperature"] == 0.7 and defaults.field_to_value["top_k"] == 20
    assert defaults.field_to_value["top_p"] == 0.95 and defaults.field_to_source["top_p"] == "tokios"
    assert "top_p=1.5" in caplog.text and "ignored" in caplog.text
    assert sampling_defaults.for_model(tmp_path / "missing").field_to_source["temperature"] == "tokios"


def test_a_converted_file_recommends_what_its_directory_did(tmp_path):
    """llama.cpp's converter's own metadata step (gguf-py's Metadata, which convert_hf_to_gguf.py
    runs) writes a directory's generation_config.json into the GGUF: both read the same. Qwen3's
    recommended values, as its generation_config.json has them."""
    directory = tmp_path / "qwen3"
    directory.mkdir()
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "temperature": 0.6,
         "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.05}))
    # The pinned llama.cpp's gguf-py, as convert_hf_to_gguf.py imports it (PyPI's lags behind it).
    script = (f"import sys; sys.path.insert(0, {str(llama_cpp_sources() / 'gguf-py')!r}); import gguf\n"
              f"writer = gguf.GGUFWriter({str(tmp_path / 'qwen3.gguf')!r}, 'qwen3')\n"
              f"gguf.Metadata.load(model_path=__import__('pathlib').Path({str(directory)!r}), model_name='Qwen3')"
              ".set_gguf_meta_model(writer)\n"
              "writer.write_header_to_file(); writer.write_kv_data_to_file(); writer.write_tensors_to_file(); "
              "writer.close()\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    from_directory = sampling_defaults.for_model(directory)
    from_file = sampling_defaults.for_model(tmp_path / "qwen3.gguf")
    assert from_file.field_to_value == pytest.approx(dict(from_directory.field_to_value))
    assert from_file.field_to_source == from_directory.field_to_source
    assert from_file.field_to_value == pytest.approx({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                                                      "repetition_penalty": 1.05})


def test_a_bad_flag_is_refused_naming_it_before_anything_loads():
    with pytest.raises(InvalidRequestError, match="top_p") as error:
        sampling_defaults.from_args(_parsed("--top-p", "0"), None)
    assert error.value.param == "top_p"
    with pytest.raises(InvalidRequestError) as error:
        sampling_defaults.from_args(_parsed("--repeat-penalty", "-1"), None)
    assert error.value.param == "repeat_penalty"


def test_a_request_keeps_its_own_values_and_gets_the_rest():
    defaults = sampling_defaults.resolve({"top_k": 20}, {"temperature": 0.3})
    kwargs = defaults.apply({"temperature": 1.0, "max_tokens": 5})
    assert kwargs == {"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.0,
                      "max_tokens": 5}
    SamplingParams(**kwargs)
    assert defaults.apply({})["temperature"] == 0.3
    assert defaults.ollama_parameters().splitlines() == [
        "temperature 0.3", "top_p 0.95", "top_k 20", "min_p 0.05", "repeat_penalty 1"]


def test_generate_and_chat_take_the_same_set_as_the_server(tmp_path):
    """`tokios generate`/`chat` with no sampling flag sample as a request to `serve` that sets
    nothing: the same function resolves both."""
    from tokios.cli import build_parser
    from tokios.commands.generate import sampling_params_from_args

    path = _gguf_with(tmp_path / "m.gguf", top_k=7)
    argv = ["generate", "hi", "--model", path, "--max-tokens", "3"]
    args = build_parser(argv).parse_args(argv)
    params = sampling_params_from_args(args)
    expected = sampling_defaults.for_model(path)
    assert {name: getattr(params, name) for name in sampling_defaults.FIELDS} == pytest.approx(
        dict(expected.field_to_value))
    assert params.top_k == 7 and params.max_tokens == 3
    argv = ["chat", "--model", path, "--temperature", "0"]
    greedy = sampling_params_from_args(build_parser(argv).parse_args(argv))
    assert greedy.temperature == 0.0 and greedy.top_k == 7


def test_serve_flags_become_every_models_defaults_and_its_card(tmp_path):
    from tokios.cli import build_parser
    from tokios.server.cli import build_registry

    first = _gguf_with(tmp_path / "a.gguf", temp=0.5)
    second = _gguf_with(tmp_path / "b.gguf")
    argv = ["serve", "--model", f"{first}=a", "--model", f"{second}=b", "--min-p", "0.1"]
    args = build_parser(argv).parse_args(argv)
    registry = build_registry(args)
    cards = {card["id"]: card for card in registry.model_cards(created=0)}
    assert cards["a"]["sampling_defaults"]["temperature"] == 0.5
    assert cards["a"]["sampling_defaults"]["source"]["temperature"] == "model"
    assert cards["b"]["sampling_defaults"]["temperature"] == 0.8
    assert all(card["sampling_defaults"]["min_p"] == 0.1 and card["sampling_defaults"]["source"]["min_p"] == "flag"
               for card in cards.values())
