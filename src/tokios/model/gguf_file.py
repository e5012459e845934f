"""A fast reader for GGUF files: key/value metadata and tensor descriptors, tensor data memory-mapped.

The `gguf` package's GGUFReader builds numpy views for every array element of the metadata
(~3 s for a 49k-token vocabulary); this reader walks the header once with `struct` and
`numpy.frombuffer`, so opening the default model takes milliseconds. Dequantization is left to
model/quant.py. Errors (missing file, bad magic, truncation) are ModelLoadError naming the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokios.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> (struct format, numpy dtype) for scalars.
_SCALAR_TYPES: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # PyTorch order (slowest first): GGUF's ne[] reversed
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class _Cursor:
    def __init__(self, buffer: memoryview, path: str):
        self.buffer = buffer
        self.position = 0
        self.path = path

    def take(self, num_bytes: int) -> memoryview:
        end = self.position + num_bytes
        if end > len(self.buffer):
            raise ModelLoadError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buffer)}, "
                                 f"needed {end})")
        view = self.buffer[self.position:end]
        self.position = end
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        return bytes(self.take(length)).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_TYPES:
            return self.scalar(_SCALAR_TYPES[value_type][0])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if item_type in _SCALAR_TYPES:
                dtype = np.dtype(_SCALAR_TYPES[item_type][1])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"{self.path}: unknown GGUF metadata value type {value_type}")


class GGUFFile:
    """Metadata and tensor descriptors of one GGUF file; tensor bytes stay memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.exists(self.path):
            raise ModelLoadError(f"model file not found: {self.path}")
        if os.path.isdir(self.path):
            raise ModelLoadError(f"{self.path} is a directory, not a GGUF file")
        size = os.path.getsize(self.path)
        if size < 24:
            raise ModelLoadError(f"{self.path}: not a GGUF file (only {size} bytes)")
        with open(self.path, "rb") as handle:
            if handle.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{self.path}: not a GGUF file (bad magic bytes)")
            self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.metadata, self.tensors = self._parse(memoryview(self._mmap), size)

    def _parse(self, buffer: memoryview, size: int) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        cursor = _Cursor(buffer, self.path)
        cursor.take(4)
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: unsupported GGUF version {version} (supported: 2, 3)")
        num_tensors = cursor.scalar("<Q")
        num_kv = cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        raw_infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            num_dims = cursor.scalar("<I")
            dims = [cursor.scalar("<Q") for _ in range(num_dims)]
            type_id = cursor.scalar("<I")
            offset = cursor.scalar("<Q")
            raw_infos.append((name, dims, type_id, offset))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cursor.position + alignment - 1) // alignment * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, dims, type_id, offset in raw_infos:
            try:
                ggml_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise ModelLoadError(f"{self.path}: tensor {name} has unknown GGML type id {type_id}") from None
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
            num_elements = int(np.prod(dims)) if dims else 1
            num_bytes = num_elements // block_size * type_size
            start = data_start + offset
            if start + num_bytes > size:
                raise ModelLoadError(f"{self.path}: truncated GGUF file (tensor {name} needs bytes up to "
                                     f"{start + num_bytes}, file has {size})")
            tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, start, num_bytes)
        return metadata, tensors

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file (no copy)."""
        info = self.tensors[name]
        return np.frombuffer(self._mmap, dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))
