"""read_gguf_metadata: same values as the gguf library on the real file; clear errors on bad files."""

from __future__ import annotations

import struct

import pytest
from gguf import GGUFReader, GGUFWriter

from tokios.errors import ModelLoadError
from tokios.model_files import default_model_path
from tokios.tokenizer import read_gguf_metadata


@pytest.fixture(scope="module")
def model_path():
    return default_model_path()


def test_every_key_equals_the_gguf_library(model_path):
    reader = GGUFReader(model_path)
    # GGUFReader adds header pseudo-fields (GGUF.version, ...); the metadata is everything else.
    expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    metadata = read_gguf_metadata(model_path)
    assert list(metadata) == list(expected)
    for key, value in expected.items():
        assert metadata[key] == value, key
        assert type(metadata[key]) is type(value), key
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert isinstance(metadata["tokenizer.ggml.add_bos_token"], bool)


def test_all_value_types_round_trip_through_gguf_writer(tmp_path):
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.5)
    writer.add_uint64("t.u64", 2**63)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1e-300)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "zażółć 日本 😀")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.25, 1.5])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.strs", ["a", "", "Ġb"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    metadata = read_gguf_metadata(path)
    reader = GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert metadata[key] == field.contents(), key
    assert metadata["t.str"] == "zażółć 日本 😀"
    assert metadata["t.u64"] == 2**63 and metadata["t.bools"] == [True, False]


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*absent.gguf"):
        read_gguf_metadata(tmp_path / "absent.gguf")


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(ModelLoadError, match="directory"):
        read_gguf_metadata(tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 this is a zip", b"{\"json\": true}"])
def test_not_a_gguf_file(tmp_path, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="not a GGUF file.*model.gguf") as excinfo:
        read_gguf_metadata(path)
    assert "\n" not in excinfo.value.message


@pytest.mark.parametrize("num_bytes_kept", [6, 20, 1000, 200_000, 1_500_000])
def test_truncated_file(tmp_path, model_path, num_bytes_kept):
    with open(model_path, "rb") as file:
        head = file.read(num_bytes_kept)
    path = tmp_path / "cut.gguf"
    path.write_bytes(head)
    with pytest.raises(ModelLoadError, match="truncated GGUF file.*cut.gguf") as excinfo:
        read_gguf_metadata(path)
    assert "\n" not in excinfo.value.message


def test_unsupported_version(tmp_path):
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    with pytest.raises(ModelLoadError, match="unsupported GGUF version 9"):
        read_gguf_metadata(path)


def test_corrupt_key_length(tmp_path):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"x" * 64)
    with pytest.raises(ModelLoadError, match="corrupt GGUF metadata.*corrupt.gguf"):
        read_gguf_metadata(path)


def test_big_endian_file(tmp_path):
    key = b"general.name"
    value = "be".encode()
    body = struct.pack(">IQQ", 3, 0, 1) + struct.pack(">Q", len(key)) + key + struct.pack(">I", 8)
    body += struct.pack(">Q", len(value)) + value
    path = tmp_path / "be.gguf"
    path.write_bytes(b"GGUF" + body)
    assert read_gguf_metadata(path) == {"general.name": "be"}
