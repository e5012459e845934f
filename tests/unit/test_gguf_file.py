"""The shared GGUF parser (tokios/gguf_file.py): the same metadata, tensor infos and tensor bytes
as the gguf library on the real model and on files GGUFWriter writes in both byte orders, and one
clear ModelLoadError, naming the file, for each way a file can be bad."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter

from tokios.errors import ModelLoadError
from tokios.gguf_file import GGUFFile, read_gguf_metadata
from tokios.model_files import default_model_path


@pytest.fixture(scope="module")
def model_path():
    return default_model_path()


@pytest.fixture(scope="module")
def reader(model_path):
    return GGUFReader(model_path)


def reader_metadata(reader: GGUFReader) -> dict:
    # GGUFReader adds header pseudo-fields (GGUF.version, ...); the metadata is everything else.
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def test_every_key_equals_the_gguf_library(model_path, reader):
    expected = reader_metadata(reader)
    metadata = read_gguf_metadata(model_path)
    assert list(metadata) == list(expected)
    for key, value in expected.items():
        assert metadata[key] == value, key
        assert type(metadata[key]) is type(value), key
    assert len(metadata["tokenizer.ggml.tokens"]) == 49152
    assert isinstance(metadata["tokenizer.ggml.add_bos_token"], bool)
    assert GGUFFile(model_path).metadata == metadata


def test_tensor_infos_and_bytes_equal_the_gguf_library(model_path, reader):
    gguf = GGUFFile(model_path)
    assert gguf.architecture == "llama" and gguf.version == 3 and gguf.byte_order == "<"
    assert gguf.data_offset == reader.data_offset
    assert list(gguf.tensors) == [tensor.name for tensor in reader.tensors]
    for tensor in reader.tensors:
        info = gguf.tensors[tensor.name]
        assert info.shape == tuple(int(dim) for dim in reversed(tensor.shape)), tensor.name
        assert info.ggml_type == tensor.tensor_type, tensor.name
        assert (info.offset, info.num_bytes, info.num_elements) == (
            tensor.data_offset, int(tensor.n_bytes), int(tensor.n_elements)), tensor.name
        raw = gguf.raw_bytes(tensor.name)
        assert raw.dtype == np.uint8 and not raw.flags.writeable
        assert np.array_equal(raw, np.asarray(tensor.data).view(np.uint8).reshape(-1)), tensor.name
    assert gguf.tensors["token_embd.weight"].ggml_type == GGMLQuantizationType.Q8_0
    assert gguf.tensors["token_embd.weight"].shape == (49152, 576)


def write_every_value_type(path, endianess: GGUFEndian = GGUFEndian.LITTLE) -> None:
    writer = GGUFWriter(str(path), arch="llama", endianess=endianess)
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
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("v", np.arange(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_all_value_types_and_tensors_round_trip_through_gguf_writer(tmp_path, endianess):
    path = tmp_path / "types.gguf"
    write_every_value_type(path, endianess)
    gguf = GGUFFile(path)
    assert gguf.byte_order == ("<" if endianess == GGUFEndian.LITTLE else ">")
    assert gguf.metadata == read_gguf_metadata(path)
    # GGUFReader.contents() flattens nested arrays ([1, 2, 3]); the parser keeps their structure.
    assert gguf.metadata.pop("t.nested") == [[1, 2], [3]]
    expected = reader_metadata(GGUFReader(path))
    del expected["t.nested"]
    assert gguf.metadata == expected
    assert gguf.metadata["t.str"] == "zażółć 日本 😀"
    assert gguf.metadata["t.u64"] == 2**63 and gguf.metadata["t.bools"] == [True, False]
    assert {name: info.shape for name, info in gguf.tensors.items()} == {"w": (3, 4), "v": (5,)}
    assert gguf.tensors["w"].offset % 32 == 0
    float_dtype = np.dtype(gguf.byte_order + "f4")
    assert gguf.raw_bytes("w").view(float_dtype).tolist() == list(range(12))
    assert gguf.raw_bytes("v").view(float_dtype).tolist() == list(range(5))


def test_metadata_alone_imports_neither_gguf_nor_torch(model_path):
    # Why: importing the gguf package costs ~0.3 s, paid by every tokenizer load if the metadata
    # reader needed it; and `tokios plan` must never import torch.
    script = (
        "import sys\n"
        "from tokios.gguf_file import GGUFFile, read_gguf_metadata\n"
        f"read_gguf_metadata({str(model_path)!r})\n"
        "assert 'gguf' not in sys.modules, 'metadata reading imported gguf'\n"
        f"assert len(GGUFFile({str(model_path)!r}).tensors) == 272\n"
        "assert 'torch' not in sys.modules, 'the parser imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["little", "big"])
def test_asking_for_some_keys_skips_every_other_value(tmp_path, endianess):
    path = tmp_path / "types.gguf"
    write_every_value_type(path, endianess)
    metadata = read_gguf_metadata(path)
    for key, value in metadata.items():  # each key read after skipping every value before it
        assert read_gguf_metadata(path, frozenset({key})) == {key: value}, key
    assert read_gguf_metadata(path, frozenset({"t.u8", "t.strs", "absent"})) == {
        "t.u8": 200, "t.strs": ["a", "", "Ġb"]}


def read_chat_template_key(path):
    return read_gguf_metadata(path, frozenset({"tokenizer.chat_template"}))


# The third reads one key and skips the rest, which must find every fault the full read finds.
PARSERS = {"metadata": read_gguf_metadata, "file": GGUFFile, "one key": read_chat_template_key}


@pytest.fixture(params=list(PARSERS))
def parse(request):
    return PARSERS[request.param]


def parse_error(parse, path) -> str:
    with pytest.raises(ModelLoadError) as raised:
        parse(path)
    message = raised.value.message
    assert "\n" not in message and str(path) in message
    return message


def test_missing_file(tmp_path, parse):
    assert "model file not found" in parse_error(parse, tmp_path / "absent.gguf")


def test_directory_is_not_a_file(tmp_path, parse):
    assert "expected a GGUF file, got a directory" in parse_error(parse, tmp_path)


@pytest.mark.parametrize("content", [b"", b"GG", b"PK\x03\x04 this is a zip", b"{\"json\": true}\n" * 4])
def test_not_a_gguf_file(tmp_path, parse, content):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    assert parse_error(parse, path).startswith(f"not a GGUF file (bad magic {content[:4]!r}")


def test_header_shorter_than_24_bytes(tmp_path, parse):
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF\x03\x00")
    message = parse_error(parse, path)
    assert "not a GGUF file" in message and "truncated GGUF file header (6 bytes" in message


@pytest.mark.parametrize("cut_after, reading", [
    (None, "metadata key #0"), ("tokenizer.ggml.tokens", "metadata key 'tokenizer.ggml.tokens'"),
    ("tokenizer.ggml.merges", "metadata key 'tokenizer.ggml.merges'"),
])
def test_truncated_metadata_names_the_key_and_the_needed_byte(tmp_path, model_path, parse, cut_after, reading):
    content = model_path.read_bytes()
    # Cut 30 bytes in, inside the first key; or 1000 bytes into the named key's value.
    num_bytes_kept = 30 if cut_after is None else content.index(cut_after.encode()) + 1000
    path = tmp_path / "cut.gguf"
    path.write_bytes(content[:num_bytes_kept])
    message = parse_error(parse, path)
    assert message.startswith(f"truncated GGUF file (reading {reading} needs bytes up to ")
    needed = int(message.split("needs bytes up to ")[1].split(",")[0])
    assert needed > num_bytes_kept and f"the file has {num_bytes_kept})" in message


def test_truncated_tensor_infos_and_tensor_data(tmp_path, model_path, reader):
    path = tmp_path / "cut.gguf"
    with open(model_path, "rb") as file:
        path.write_bytes(file.read(reader.data_offset - 100))
    read_gguf_metadata(path)  # the metadata section is whole
    assert "truncated GGUF file (reading tensor info " in parse_error(GGUFFile, path)
    with open(model_path, "rb") as file:
        path.write_bytes(file.read(2_000_000))
    message = parse_error(GGUFFile, path)
    end = reader.tensors[0].data_offset + reader.tensors[0].n_bytes
    assert f"truncated GGUF file (tensor token_embd.weight needs bytes up to {end}, the file has 2000000)" in message


def test_unsupported_version(tmp_path, parse):
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 9, 0, 0))
    assert "unsupported GGUF version 9 (supported: 2, 3)" in parse_error(parse, path)


def test_corrupt_key_length(tmp_path, parse):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**40) + b"x" * 64)
    assert "corrupt GGUF metadata key (metadata key length 1099511627776 at byte 24" in parse_error(parse, path)


def test_unknown_value_type_names_the_key(tmp_path, parse):
    path = tmp_path / "odd.gguf"
    key = b"general.odd"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 77) + b"\0" * 8)
    assert "unknown GGUF value type 77 for key 'general.odd'" in parse_error(parse, path)


def write_with_tensor_patch(path, patch_at_type: int | None = None, patch_dims: int | None = None) -> None:
    """A small file with tensor `w`, then its tensor info's type id or dimension count overwritten."""
    write_every_value_type(path)
    data = bytearray(path.read_bytes())
    # Tensor info: name (u64 length + bytes), n_dims u32, dims u64 x n_dims, type u32, offset u64.
    name_end = data.index(struct.pack("<Q", 1) + b"w") + 9
    if patch_dims is not None:
        data[name_end:name_end + 4] = struct.pack("<I", patch_dims)
    if patch_at_type is not None:
        type_at = name_end + 4 + 2 * 8
        assert struct.unpack_from("<I", data, type_at)[0] == GGMLQuantizationType.F32
        data[type_at:type_at + 4] = struct.pack("<I", patch_at_type)
    path.write_bytes(bytes(data))


def test_unknown_ggml_type_id_names_the_tensor(tmp_path):
    path = tmp_path / "weird.gguf"
    write_with_tensor_patch(path, patch_at_type=99)
    read_gguf_metadata(path)  # the metadata reader never looks at tensor infos
    assert "tensor w has unknown GGML type id 99" in parse_error(GGUFFile, path)


def test_row_length_must_fill_whole_blocks(tmp_path):
    path = tmp_path / "rows.gguf"
    write_with_tensor_patch(path, patch_at_type=GGMLQuantizationType.Q4_0)  # rows of 4, blocks of 32
    assert "tensor w: row length 4 is not a multiple of the Q4_0 block size 32" in parse_error(GGUFFile, path)


def test_too_many_dimensions(tmp_path):
    path = tmp_path / "dims.gguf"
    write_with_tensor_patch(path, patch_dims=9)
    assert "tensor 'w' has 9 dimensions, at most 4" in parse_error(GGUFFile, path)


@pytest.mark.parametrize("alignment", [0, 24])
def test_alignment_must_be_a_power_of_two(tmp_path, alignment):
    path = tmp_path / "align.gguf"
    writer = GGUFWriter(str(path), arch="llama")
    writer.add_uint32("general.alignment", alignment)  # add_custom_alignment refuses bad values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    assert f"general.alignment must be a power of two, got {alignment}" in parse_error(GGUFFile, path)
