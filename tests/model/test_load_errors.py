"""Bad model files fail with one typed, one-line error that names the problem, never a traceback
from deep inside: a missing file, a file that is not GGUF, a truncated GGUF (cut in the header
and cut in the tensor data), an unknown architecture, an unknown tensor type (both one that
tokios does not implement and a type id no GGUF version defines), missing metadata, and a
variant of a supported architecture that is not implemented (Gemma 4 with MoE blocks). The
command line turns the same errors into one line on stderr and exit status 1.

Small GGUF files are written here with the `gguf` package's GGUFWriter.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from reference import default_gguf
from tokios.errors import ModelLoadError, UnsupportedError


def load(path):
    from tokios.engine import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory="16MiB")


def load_error(path) -> ModelLoadError:
    with pytest.raises(ModelLoadError) as raised:
        load(path)
    message = raised.value.message
    assert message and "\n" not in message
    return raised.value


def write_gguf(path, architecture: str, tensor_type=GGMLQuantizationType.F32, with_block_count: bool = True):
    writer = GGUFWriter(str(path), arch=architecture)
    if with_block_count:
        writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_context_length(64)
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    else:  # raw bytes of one 256-element block per row
        block_bytes = {GGMLQuantizationType.IQ2_XXS: 66}[tensor_type]
        writer.add_tensor("token_embd.weight", np.zeros((16, block_bytes), dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_missing_file(tmp_path):
    path = tmp_path / "missing.gguf"
    error = load_error(path)
    assert "not found" in error.message and str(path) in error.message


def test_directory_without_config(tmp_path):
    error = load_error(tmp_path)
    assert "config.json" in error.message


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n" * 10)
    error = load_error(path)
    assert "not a GGUF file" in error.message and str(path) in error.message


def test_tiny_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF\x03\x00")
    assert "not a GGUF file" in load_error(path).message


@pytest.mark.parametrize("num_bytes", [4096, 2_000_000], ids=["cut_in_header", "cut_in_tensor_data"])
def test_truncated_gguf(tmp_path, num_bytes):
    path = tmp_path / "truncated.gguf"
    with open(default_gguf(), "rb") as source:
        path.write_bytes(source.read(num_bytes))
    error = load_error(path)
    assert "truncated GGUF file" in error.message and str(path) in error.message


def test_unknown_architecture(tmp_path):
    path = write_gguf(tmp_path / "foo.gguf", "foo")
    with pytest.raises(UnsupportedError) as raised:
        load(path)
    assert "'foo'" in raised.value.message and "llama" in raised.value.message
    assert "\n" not in raised.value.message


def test_tensor_type_tokios_does_not_implement(tmp_path):
    path = write_gguf(tmp_path / "iq2.gguf", "llama", tensor_type=GGMLQuantizationType.IQ2_XXS)
    with pytest.raises(UnsupportedError) as raised:
        load(path)
    message = raised.value.message
    assert "IQ2_XXS" in message and "token_embd.weight" in message and "Q4_1" in message
    assert "\n" not in message


def test_tensor_type_id_no_gguf_defines(tmp_path):
    path = write_gguf(tmp_path / "weird.gguf", "llama")
    data = bytearray(path.read_bytes())
    # Tensor info: name (u64 length + bytes), n_dims u32, dims u64 x n_dims, type u32, offset u64.
    name = b"token_embd.weight"
    type_at = data.index(name) + len(name) + 4 + 2 * 8
    assert int.from_bytes(data[type_at:type_at + 4], "little") == GGMLQuantizationType.F32
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    error = load_error(path)
    assert "unknown GGML type id 99" in error.message and "token_embd.weight" in error.message


def test_missing_metadata_key(tmp_path):
    path = write_gguf(tmp_path / "partial.gguf", "llama", with_block_count=False)
    assert "llama.block_count" in load_error(path).message


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokios.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_with_a_missing_model_exits_1_with_one_line(tmp_path):
    path = tmp_path / "missing.gguf"
    result = run_cli("generate", "Hello", "--model", str(path))
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("tokios generate: error:") and "not found" in lines[0] and str(path) in lines[0]


def test_serve_with_a_missing_model_says_so_before_it_listens(tmp_path):
    path = tmp_path / "missing.gguf"
    result = run_cli("serve", "--model", str(path), "--port", "0")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no "listening on", no uvicorn start-up and shutdown
    assert lines[0].startswith("tokios serve: error: model:") and str(path) in lines[0]


@pytest.mark.parametrize("port", ["80000", "-1"])
def test_serve_with_an_impossible_port_exits_1_with_one_line(port):
    result = run_cli("serve", "--port", port)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"tokios serve: error: port: {port} is not a TCP port (0-65535; 0 picks a free one)"]


def test_generate_with_a_bad_dtype_exits_1_with_one_line():
    result = run_cli("generate", "Hello", "--dtype", "float8")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "dtype" in lines[0] and "float8" in lines[0] and "bfloat16" in lines[0]


def test_chat_with_a_non_gguf_file_exits_1_with_one_line(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("not a model")
    result = run_cli("chat", "--model", str(path))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a GGUF file" in lines[0], result.stderr


def test_block_type_whose_blocks_do_not_fit_the_shape(tmp_path):
    """A Q8_0 tensor of 16 x 8 weights: its 8-weight rows are no whole number of 32-weight blocks."""
    path = write_gguf(tmp_path / "misfit.gguf", "llama")
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    type_at = data.index(name) + len(name) + 4 + 2 * 8
    data[type_at:type_at + 4] = int(GGMLQuantizationType.Q8_0).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    error = load_error(path)
    assert "token_embd.weight" in error.message and "Q8_0" in error.message and "block size 32" in error.message
