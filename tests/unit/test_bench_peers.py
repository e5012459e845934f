"""peers: model lookup, server subprocess lifecycle, prompt tokenizer, llama-server lookup."""

import importlib.util
import random
import sys

import pytest

from tokios.errors import ModelLoadError, TokiosError
from tokios.tools.bench import peers
from tokios.tools.bench.prompts import make_prompt, make_token_ids


def test_default_model_is_found_and_bad_paths_are_named(tmp_path):
    assert peers.default_model_path().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with pytest.raises(ModelLoadError, match="must be a GGUF file"):
        peers.resolve_model_path(str(tmp_path / "missing.gguf"))
    # A Hugging Face directory: only where no llama.cpp peer has to read it (bench offline).
    with pytest.raises(ModelLoadError, match="GGUF file for llama.cpp.*--systems tokios,transformers"):
        peers.resolve_model_path(str(tmp_path))
    assert peers.resolve_model_path(str(tmp_path), directory_ok=True) == str(tmp_path)


def test_server_process_waits_for_health_reports_memory_and_tears_down(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = peers.free_port()
    server = peers.ServerProcess("http", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                          "--directory", str(tmp_path)], port, log_path=tmp_path / "http.log")
    with server.start(timeout_s=30):
        assert server.process.poll() is None
        assert server.peak_rss_bytes() > 1024 * 1024  # a Python interpreter is well over 1 MiB
    assert server.process.poll() is not None  # stopped on leaving the block


def test_server_process_that_dies_early_is_a_one_line_error_with_its_log(tmp_path):
    port = peers.free_port()
    server = peers.ServerProcess("broken", [sys.executable, "-c", "import sys; print('bad flag --x'); sys.exit(3)"],
                                 port, log_path=tmp_path / "broken.log")
    with pytest.raises(TokiosError, match=r"broken exited with code 3(.|\n)*bad flag --x"):
        server.start(timeout_s=30)


def test_explicit_llama_server_must_be_executable(tmp_path):
    not_executable = tmp_path / "llama-server"
    not_executable.write_text("")
    with pytest.raises(TokiosError, match="llama_server must be an executable"):
        peers.find_llama_server(str(not_executable))


def test_prompts_have_exact_token_lengths_with_the_real_tokenizer():
    codec = peers.load_prompt_codec()
    assert codec is not None
    rng = random.Random(0)
    for num_tokens in (1, 5, 128, 512):
        assert len(codec.encode(make_prompt(num_tokens, rng, codec))) == num_tokens
        assert len(make_token_ids(num_tokens, rng, codec)) == num_tokens
    # Two prompts of the same length from one generator do not share a start.
    first, second = make_token_ids(64, rng, codec), make_token_ids(64, rng, codec)
    assert first[:4] != second[:4]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed here")
def test_bench_offline_without_llama_cpp_python_says_so_before_loading_anything():
    import subprocess

    result = subprocess.run([sys.executable, "-m", "tokios.cli", "bench", "offline"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no "loading tokios ..." first
    assert "llama-cpp-python is not installed" in lines[0] and "--systems tokios,transformers" in lines[0]
