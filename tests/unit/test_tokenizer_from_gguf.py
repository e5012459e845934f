"""What the tokenizer reads from a GGUF file through the shared parser (tokios/gguf_file.py, tested
in test_gguf_file.py): the file's vocabulary, and a GGUF file recognised by its magic."""

from __future__ import annotations

from tokios.gguf_file import read_gguf_metadata
from tokios.model_files import default_model_path
from tokios.tokenizer.tokenizer import load_tokenizer


def test_vocabulary_read_from_the_file():
    metadata = read_gguf_metadata(default_model_path())
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == 49152 and all(isinstance(token, str) for token in tokens)
    assert tokens[metadata["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert metadata["tokenizer.ggml.pre"] == "smollm"


def test_a_gguf_file_without_the_suffix_is_recognised_by_its_magic(tmp_path):
    renamed = tmp_path / "model.bin"
    renamed.symlink_to(default_model_path())
    assert load_tokenizer(renamed).encode("Hi there") == load_tokenizer(default_model_path()).encode("Hi there")


def test_a_model_file_loaded_again_reuses_its_tokenizer_until_the_file_changes(tmp_path):
    import os
    import shutil

    from tokios.tokenizer import tokenizer_for_loaded_model

    path = shutil.copy(default_model_path(), tmp_path / "model.gguf")
    metadata = read_gguf_metadata(path)
    first = tokenizer_for_loaded_model(metadata, str(path))
    assert tokenizer_for_loaded_model(metadata, str(path)) is first
    status = os.stat(path)
    os.utime(path, ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000))
    rebuilt = tokenizer_for_loaded_model(metadata, str(path))
    assert rebuilt is not first and rebuilt.encode("Hi there") == first.encode("Hi there")
