"""The one GGUF header parser: key/value metadata, tensor infos, tensor bytes memory-mapped.

Owns `GGUFFile(path)` (metadata, `tensors` name -> TensorInfo, `raw_bytes(name)`) and
`read_gguf_metadata(path, keys)` (the key/value section only: all of it, or the keys asked for).
Used by the tokenizer (vocabulary, merges, chat template), the model loader (hyper-parameters and
weights) and `tokios plan` (shapes and exact weight bytes). It imports no torch, so `tokios plan` stays instant, and the
`gguf` package (slow to import) only when tensor infos are read: the tokenizer never pays it.

Why not `gguf.GGUFReader`: it builds a numpy view per array element and converts the 49k-entry
token arrays one by one (seconds on SmolLM2). Here the header is walked once over a memory map:
string arrays in one tight loop, numeric arrays with one `numpy.frombuffer` each.

Layout (GGUF v2/v3; little-endian unless the version reads byte-swapped, which marks big-endian):
    magic "GGUF" | version u32 | tensor count u64 | kv count u64
    | kv count x (key string, value type u32, value)
    | tensor count x (name string, n_dims u32, ne[n_dims] u64, ggml type u32, offset u64)
    | padding to general.alignment | tensor data (each tensor at data start + its offset)
    string = u64 byte length + UTF-8 bytes; array = element type u32 + count u64 + elements.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tokios.errors import ModelLoadError

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
HEADER_NUM_BYTES = 24  # magic, version u32, tensor count u64, kv count u64

_TYPE_STRING, _TYPE_ARRAY = 8, 9
# GGUF value type code -> struct format char of a fixed-size scalar.
_SCALAR_TYPE_TO_FORMAT: dict[int, str] = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d",
}

# No sane key or tensor name is this long, and ggml tensors have at most 4 dimensions; a bigger
# number means a corrupt header, and checking it early gives a clear message, not a huge loop.
_MAX_NAME_BYTES = 1 << 16
_MAX_TENSOR_DIMS = 4


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (slowest first): GGUF's ne[] reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int

    @property
    def num_elements(self) -> int:
        return math.prod(self.shape)


class _TruncatedError(Exception):
    """A read ran past the end of the file; `needed_end` is the byte offset it needed."""

    def __init__(self, needed_end: int):
        super().__init__(needed_end)
        self.needed_end = needed_end


class _HeaderReader:
    """Cursor over the mapped file; `context` says what is being read, for error messages."""

    def __init__(self, buffer: mmap.mmap, byte_order: str, path: str):
        self.buffer = buffer
        self.size = len(buffer)
        self.offset = 0
        self.byte_order = byte_order
        self.path = path
        self.context = "the header"
        self.u32 = struct.Struct(byte_order + "I")
        self.u64 = struct.Struct(byte_order + "Q")
        self.scalar_structs = {code: struct.Struct(byte_order + fmt) for code, fmt in _SCALAR_TYPE_TO_FORMAT.items()}
        # key -> (GGUF value type code, element type code of an array or None), for writers that
        # copy a file's metadata as stored.
        self.value_types: dict[str, tuple[int, int | None]] = {}

    def error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{problem}: {self.path}")

    def _need(self, num_bytes: int) -> None:
        if self.offset + num_bytes > self.size:
            raise _TruncatedError(self.offset + num_bytes)

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

    def read_name(self, what: str) -> str:
        length_offset = self.offset
        num_bytes = self.read_u64()
        if num_bytes > _MAX_NAME_BYTES:
            raise self.error(f"corrupt GGUF {what} ({what} length {num_bytes} at byte {length_offset}, "
                             f"at most {_MAX_NAME_BYTES})")
        self.offset = length_offset
        return self.read_string()

    def read_value(self, type_code: int, key: str) -> Any:
        if type_code == _TYPE_STRING:
            return self.read_string()
        if type_code == _TYPE_ARRAY:
            return self.read_array(key)
        scalar = self.scalar_structs.get(type_code)
        if scalar is None:
            raise self.error(f"unknown GGUF value type {type_code} for key {key!r}")
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
            raise self.error(f"unknown GGUF array element type {element_type} for key {key!r}")
        dtype = np.dtype(np.bool_) if fmt == "?" else np.dtype(self.byte_order + fmt)
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
                raise _TruncatedError(offset + 8)
            (num_bytes,) = unpack_length(buffer, offset)
            offset += 8
            end = offset + num_bytes
            if end > size:
                raise _TruncatedError(end)
            append(buffer[offset:end].decode("utf-8", errors="replace"))
            offset = end
        self.offset = offset
        return strings

    def read_counts(self) -> tuple[int, int, int]:
        """(version, number of tensors, number of key/value pairs), after the magic."""
        self.offset = len(GGUF_MAGIC)
        version = self.read_u32()
        if version not in SUPPORTED_VERSIONS:
            supported = ", ".join(map(str, SUPPORTED_VERSIONS))
            raise self.error(f"unsupported GGUF version {version} (supported: {supported})")
        return version, self.read_u64(), self.read_u64()

    def skip_value(self, type_code: int, key: str) -> None:
        """Move past a value without building it (a string array: its lengths only)."""
        if type_code == _TYPE_STRING:
            num_bytes = self.read_u64()
            self._need(num_bytes)
            self.offset += num_bytes
        elif type_code == _TYPE_ARRAY:
            element_type = self.read_u32()
            num_elements = self.read_u64()
            scalar = self.scalar_structs.get(element_type)
            if scalar is not None:
                self._need(scalar.size * num_elements)
                self.offset += scalar.size * num_elements
            elif element_type == _TYPE_STRING:  # a vocabulary: hundreds of thousands, a tight loop
                buffer, size, offset, unpack_length = self.buffer, self.size, self.offset, self.u64.unpack_from
                for _ in range(num_elements):
                    if offset + 8 > size:
                        raise _TruncatedError(offset + 8)
                    offset += 8 + unpack_length(buffer, offset)[0]
                if offset > size:
                    raise _TruncatedError(offset)
                self.offset = offset
            else:
                for _ in range(num_elements):
                    self.skip_value(element_type, key)
        else:
            self.read_value(type_code, key)

    def read_metadata(self, num_kv: int, keys: frozenset[str] | None = None) -> dict[str, Any]:
        """Every key's value, or only those of `keys` (the others are skipped, not decoded)."""
        metadata: dict[str, Any] = {}
        for index in range(num_kv):
            self.context = f"metadata key #{index}"
            key = self.read_name("metadata key")
            self.context = f"metadata key {key!r}"
            value_type = self.read_u32()
            value_offset = self.offset
            if keys is not None and key not in keys:
                self.skip_value(value_type, key)
                continue
            metadata[key] = self.read_value(value_type, key)
            # An array's element type is its first u32, read above.
            element_type = self.u32.unpack_from(self.buffer, value_offset)[0] if value_type == _TYPE_ARRAY else None
            self.value_types[key] = (value_type, element_type)
        return metadata

    def read_tensor_infos(self, num_tensors: int) -> list[tuple[str, list[int], int, int]]:
        """(name, ne[] in GGUF order, ggml type id, offset from the data start) per tensor."""
        infos = []
        for index in range(num_tensors):
            self.context = f"tensor info #{index}"
            name = self.read_name("tensor name")
            self.context = f"tensor info {name!r}"
            num_dims = self.read_u32()
            if num_dims > _MAX_TENSOR_DIMS:
                raise self.error(f"corrupt GGUF tensor info (tensor {name!r} has {num_dims} dimensions, "
                                 f"at most {_MAX_TENSOR_DIMS})")
            dims = [self.read_u64() for _ in range(num_dims)]
            infos.append((name, dims, self.read_u32(), self.read_u64()))
        return infos

    def truncated(self, exc: _TruncatedError) -> ModelLoadError:
        return self.error(f"truncated GGUF file (reading {self.context} needs bytes up to {exc.needed_end}, "
                          f"the file has {self.size})")


def _map_file(path: str) -> tuple[mmap.mmap, str]:
    """Open and memory-map a GGUF file after checking its magic; returns (map, byte order)."""
    try:
        file = open(path, "rb")
    except FileNotFoundError:
        raise ModelLoadError(f"model file not found: {path}") from None
    except IsADirectoryError:
        raise ModelLoadError(f"expected a GGUF file, got a directory: {path}") from None
    except OSError as exc:
        raise ModelLoadError(f"cannot open model file {path}: {exc.strerror}") from None
    with file:
        header = file.read(HEADER_NUM_BYTES)
        if header[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"not a GGUF file (bad magic {header[:4]!r}, expected {GGUF_MAGIC!r}): {path}")
        if len(header) < HEADER_NUM_BYTES:
            raise ModelLoadError(f"not a GGUF file: truncated GGUF file header ({len(header)} bytes, "
                                 f"the header needs {HEADER_NUM_BYTES}): {path}")
        (version_le,) = struct.unpack_from("<I", header, 4)
        # A big-endian file stores the small version number byte-swapped, so it reads huge here.
        byte_order = "<" if version_le < 0x10000 else ">"
        # mmap: the header is parsed in place, only the pages it spans are read, and tensor data
        # is handed out as views of the same map.
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ), byte_order


def read_gguf_metadata(path: str | os.PathLike[str], keys: frozenset[str] | None = None) -> dict[str, Any]:
    """Every key/value pair of a GGUF file's metadata as plain Python values, or only those of
    `keys` (the rest skipped, not decoded: Gemma 3's chat template alone takes a quarter of the
    time of the whole); tensors are not read.

    Arrays become lists, strings str, integers int, floats float, booleans bool. Raises
    ModelLoadError naming the file for a missing, non-GGUF, unsupported or truncated file.
    """
    path_text = os.fspath(path)
    buffer, byte_order = _map_file(path_text)
    try:
        reader = _HeaderReader(buffer, byte_order, path_text)
        try:
            _, _, num_kv = reader.read_counts()
            return reader.read_metadata(num_kv, keys)
        except _TruncatedError as exc:
            raise reader.truncated(exc) from None
    finally:
        buffer.close()


class GGUFFile:
    """Metadata and tensor infos of one GGUF file; tensor bytes stay memory-mapped.

    Attributes: path, version, byte_order ("<" or ">"), metadata (key -> plain Python value),
    value_types (key -> (GGUF value type code, an array's element type code or None)), tensors
    (name -> TensorInfo, in file order), data_offset (where tensor data starts).
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self._mmap, self.byte_order = _map_file(self.path)
        reader = _HeaderReader(self._mmap, self.byte_order, self.path)
        try:
            self.version, num_tensors, num_kv = reader.read_counts()
            self.metadata = reader.read_metadata(num_kv)
            self.value_types = reader.value_types
            raw_infos = reader.read_tensor_infos(num_tensors)
        except _TruncatedError as exc:
            raise reader.truncated(exc) from None
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ModelLoadError(f"general.alignment must be a power of two, got {alignment!r}: {self.path}")
        self.data_offset = (reader.offset + alignment - 1) // alignment * alignment
        self.tensors = {info.name: info for info in map(self._tensor_info, raw_infos)}

    def _tensor_info(self, raw_info: tuple[str, list[int], int, int]) -> TensorInfo:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        name, dims, type_id, relative_offset = raw_info
        try:
            ggml_type = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"tensor {name} has unknown GGML type id {type_id}: {self.path}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block_size:
            raise ModelLoadError(f"tensor {name}: row length {dims[0]} is not a multiple of the "
                                 f"{ggml_type.name} block size {block_size}: {self.path}")
        num_bytes = math.prod(dims) // block_size * type_size
        start = self.data_offset + relative_offset
        file_size = len(self._mmap)
        if start + num_bytes > file_size:
            raise ModelLoadError(f"truncated GGUF file (tensor {name} needs bytes up to {start + num_bytes}, "
                                 f"the file has {file_size}): {self.path}")
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, start, num_bytes)

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
