"""Fast reader for the key/value metadata section of a GGUF file.

Owns `read_gguf_metadata(path)`, used by the tokenizer (vocabulary, merges, chat template) and by
the model loader (architecture hyper-parameters). It parses only the header and the key/value
section, following the GGUF v2/v3 layout, and never touches tensor data.

Why not `gguf.GGUFReader`: it builds numpy views for every field and then converts the 49k-entry
token arrays element by element (about 2.3 s on SmolLM2). Here string arrays are read in one
tight loop over a memory map and numeric arrays in one `numpy.frombuffer` each.

Layout (little-endian unless the version reads byte-swapped, which marks a big-endian file):
    magic "GGUF" | version u32 | tensor_count u64 | kv_count u64 | kv_count x (key, type u32, value)
    string = u64 byte length + UTF-8 bytes; array = element type u32 + count u64 + elements.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import numpy as np

from tokios.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)

# GGUF value type code -> (struct format char, numpy dtype) for fixed-size scalars.
_TYPE_UINT8, _TYPE_INT8, _TYPE_UINT16, _TYPE_INT16 = 0, 1, 2, 3
_TYPE_UINT32, _TYPE_INT32, _TYPE_FLOAT32, _TYPE_BOOL = 4, 5, 6, 7
_TYPE_STRING, _TYPE_ARRAY, _TYPE_UINT64, _TYPE_INT64, _TYPE_FLOAT64 = 8, 9, 10, 11, 12

_SCALAR_TYPE_TO_FORMAT: dict[int, str] = {
    _TYPE_UINT8: "B",
    _TYPE_INT8: "b",
    _TYPE_UINT16: "H",
    _TYPE_INT16: "h",
    _TYPE_UINT32: "I",
    _TYPE_INT32: "i",
    _TYPE_FLOAT32: "f",
    _TYPE_BOOL: "?",
    _TYPE_UINT64: "Q",
    _TYPE_INT64: "q",
    _TYPE_FLOAT64: "d",
}

# Keys that can never be this long in a sane file; a bigger length means a corrupt header, and
# checking it early gives a clear message instead of a huge allocation.
_MAX_KEY_BYTES = 1 << 16


class _TruncatedError(Exception):
    """Raised internally when a read runs past the end of the file."""


class _MetadataParser:
    """Cursor over the memory-mapped header; one instance per file read."""

    def __init__(self, buffer: mmap.mmap | bytes, byte_order: str):
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = 0
        self.byte_order = byte_order
        self.u64 = struct.Struct(byte_order + "Q")
        self.u32 = struct.Struct(byte_order + "I")
        self.scalar_structs = {
            type_code: struct.Struct(byte_order + fmt) for type_code, fmt in _SCALAR_TYPE_TO_FORMAT.items()
        }

    def _need(self, num_bytes: int) -> None:
        if self.offset + num_bytes > self.size:
            raise _TruncatedError

    def read_u32(self) -> int:
        self._need(4)
        (value,) = self.u32.unpack_from(self.buffer, self.offset)
        self.offset += 4
        return value

    def read_u64(self) -> int:
        self._need(8)
        (value,) = self.u64.unpack_from(self.buffer, self.offset)
        self.offset += 8
        return value

    def read_string(self) -> str:
        num_bytes = self.read_u64()
        self._need(num_bytes)
        start = self.offset
        self.offset += num_bytes
        return self.buffer[start : self.offset].decode("utf-8", errors="replace")

    def read_value(self, type_code: int, key: str) -> Any:
        if type_code == _TYPE_STRING:
            return self.read_string()
        if type_code == _TYPE_ARRAY:
            return self.read_array(key)
        scalar = self.scalar_structs.get(type_code)
        if scalar is None:
            raise ModelLoadError(f"unknown GGUF value type {type_code} for key {key!r}")
        self._need(scalar.size)
        (value,) = scalar.unpack_from(self.buffer, self.offset)
        self.offset += scalar.size
        return value

    def read_array(self, key: str) -> list[Any]:
        element_type = self.read_u32()
        num_elements = self.read_u64()
        if element_type == _TYPE_STRING:
            return self._read_string_array(num_elements)
        if element_type == _TYPE_ARRAY:
            return [self.read_array(key) for _ in range(num_elements)]
        fmt = _SCALAR_TYPE_TO_FORMAT.get(element_type)
        if fmt is None:
            raise ModelLoadError(f"unknown GGUF array element type {element_type} for key {key!r}")
        dtype = np.dtype(self.byte_order + fmt) if fmt != "?" else np.dtype(np.bool_)
        num_bytes = dtype.itemsize * num_elements
        self._need(num_bytes)
        values = np.frombuffer(self.buffer, dtype=dtype, count=num_elements, offset=self.offset)
        self.offset += num_bytes
        # tolist() yields plain Python ints/floats/bools, the same values GGUFReader reports.
        return values.tolist()

    def _read_string_array(self, num_elements: int) -> list[str]:
        # The hot loop of the whole reader (49k tokens + 49k merges): locals only, no method calls.
        buffer, size, offset = self.buffer, self.size, self.offset
        unpack_length = self.u64.unpack_from
        strings: list[str] = []
        append = strings.append
        for _ in range(num_elements):
            if offset + 8 > size:
                raise _TruncatedError
            (num_bytes,) = unpack_length(buffer, offset)
            offset += 8
            end = offset + num_bytes
            if end > size:
                raise _TruncatedError
            append(buffer[offset:end].decode("utf-8", errors="replace"))
            offset = end
        self.offset = offset
        return strings


def _detect_byte_order(header: bytes) -> str:
    (version_le,) = struct.unpack_from("<I", header, 4)
    # A big-endian file stores the small version number byte-swapped, so it reads huge here.
    return "<" if version_le < 0x10000 else ">"


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Return every key/value pair of a GGUF file's metadata as plain Python values.

    Arrays become lists, strings str, integers int, floats float, booleans bool. Tensor data is
    not read. Raises ModelLoadError naming the file for a missing, non-GGUF or truncated file.
    """
    path_text = os.fspath(path)
    try:
        file = open(path_text, "rb")
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path_text}") from None
    except IsADirectoryError:
        raise ModelLoadError(f"expected a GGUF file, got a directory: {path_text}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot open model file {path_text}: {exc.strerror}") from None
    with file:
        file_size = os.fstat(file.fileno()).st_size
        header = file.read(8)
        if len(header) < 4 or header[:4] != GGUF_MAGIC:
            raise ModelLoadError(
                f"not a GGUF file (bad magic {header[:4]!r}, expected {GGUF_MAGIC!r}): {path_text}"
            )
        if len(header) < 8:
            raise ModelLoadError(f"truncated GGUF file (header ends after {file_size} bytes): {path_text}")
        byte_order = _detect_byte_order(header)
        # mmap: the metadata is parsed in place, and only the pages it spans are ever read.
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            return _parse_metadata(buffer, byte_order, path_text)
        finally:
            buffer.close()


def _parse_metadata(buffer: mmap.mmap, byte_order: str, path_text: str) -> dict[str, Any]:
    parser = _MetadataParser(buffer, byte_order)
    parser.offset = 4
    key = "<header>"
    try:
        version = parser.read_u32()
        if version not in SUPPORTED_VERSIONS:
            raise ModelLoadError(
                f"unsupported GGUF version {version} (supported: {', '.join(map(str, SUPPORTED_VERSIONS))}): "
                f"{path_text}"
            )
        parser.read_u64()  # tensor count: the model loader reads tensor infos itself
        num_kv = parser.read_u64()
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = "<key>"
            key_length_offset = parser.offset
            key_length = parser.read_u64()
            if key_length > _MAX_KEY_BYTES:
                raise ModelLoadError(
                    f"corrupt GGUF metadata (key length {key_length} at byte {key_length_offset}): {path_text}"
                )
            parser.offset = key_length_offset
            key = parser.read_string()
            value_type = parser.read_u32()
            metadata[key] = parser.read_value(value_type, key)
        return metadata
    except _TruncatedError:
        raise ModelLoadError(
            f"truncated GGUF file (metadata ends early while reading {key!r}, file is {parser.size} bytes): "
            f"{path_text}"
        ) from None
    except ModelLoadError as exc:
        if path_text in exc.message:
            raise
        raise ModelLoadError(f"{exc.message}: {path_text}") from None
