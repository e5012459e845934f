"""The tokenizer's GGUF names are the shared parser's (tokios/gguf_file.py, tested in
test_gguf_file.py), and what the tokenizer reads through them is the file's vocabulary."""

from __future__ import annotations

import tokios.gguf_file
import tokios.tokenizer
import tokios.tokenizer.gguf_metadata
from tokios.model_files import default_model_path
from tokios.tokenizer.tokenizer import load_tokenizer


def test_tokenizer_names_are_the_shared_parser():
    assert tokios.tokenizer.read_gguf_metadata is tokios.gguf_file.read_gguf_metadata
    assert tokios.tokenizer.gguf_metadata.read_gguf_metadata is tokios.gguf_file.read_gguf_metadata
    assert tokios.tokenizer.gguf_metadata.GGUF_MAGIC == tokios.gguf_file.GGUF_MAGIC == b"GGUF"


def test_vocabulary_read_through_the_tokenizer_name():
    metadata = tokios.tokenizer.read_gguf_metadata(default_model_path())
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(token, str) for token in tokens)
    assert tokens[metadata["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert metadata["tokenizer.ggml.pre"] == "smollm"


def test_a_gguf_file_without_the_suffix_is_recognised_by_its_magic(tmp_path):
    renamed = tmp_path / "model.bin"
    renamed.symlink_to(default_model_path())
    assert load_tokenizer(renamed).encode("Hi there") == load_tokenizer(default_model_path()).encode("Hi there")
