"""Whether a model can chat, read before it loads (tokenizer.py model_chat_template): a GGUF
file's template key, a Hugging Face directory's chat_template.jinja over its
tokenizer_config.json; `tokios serve` reads it into each model's spec at start, and
--chat-template gives every model one. The refusal is the loaded tokenizer's own."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from gguf import GGUFWriter

from tokios.errors import InvalidRequestError
from tokios.model_files import default_model_path, gemma3_model_path
from tokios.server.cli import add_arguments, build_registry
from tokios.tokenizer.tokenizer import load_tokenizer, model_chat_template, no_chat_template_error


def test_a_gguf_file_has_the_template_its_metadata_carries(tmp_path):
    assert model_chat_template(default_model_path()).startswith("{% for message in messages %}")
    assert model_chat_template(gemma3_model_path()) is None  # the pretrained model
    path = tmp_path / "empty-template.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_string("tokenizer.chat_template", "")
    writer.add_tensor("w", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert model_chat_template(path) is None  # as the tokenizer takes an empty one: none


def test_a_directory_template_file_wins_over_tokenizer_config(tmp_path):
    assert model_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert model_chat_template(tmp_path) == "from config"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}]}))
    assert model_chat_template(tmp_path) == "named"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert model_chat_template(tmp_path) == "from jinja"


def test_the_early_refusal_is_the_tokenizers_own():
    with pytest.raises(InvalidRequestError) as late:
        load_tokenizer(gemma3_model_path()).apply_chat_template([{"role": "user", "content": "Hi"}])
    early = no_chat_template_error()
    assert (late.value.message, late.value.param, late.value.status) == (early.message, early.param, 400)


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_serve_reads_each_models_template_at_start_and_the_flag_gives_every_model_one():
    models = ["--model", f"{default_model_path()}=smol", "--model", f"{gemma3_model_path()}=gemma"]
    registry = build_registry(serve_args(*models))
    assert {entry.name: entry.spec.has_chat_template for entry in registry.entries} == {"smol": True, "gemma": False}
    registry = build_registry(serve_args(*models, "--chat-template", "gemma"))
    assert all(entry.spec.has_chat_template for entry in registry.entries)
