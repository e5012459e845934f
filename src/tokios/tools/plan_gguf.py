"""A fast reader of a GGUF file's header: metadata and tensor infos, no tensor data.

Owns `read_gguf_header(path) -> GGUFHeader`, used by tools/model_presets.py to get a model's
shapes and exact weight bytes for `tokios plan`. gguf.GGUFReader builds a numpy view of every
array (the tokenizer's ~100k strings) and takes seconds; the plan needs only the array lengths,
so this walks the header with struct over an mmap and skips array contents. Tensor byte sizes come
from gguf's own table of (block size, bytes per block) per quantization type.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

from tokios.errors import ModelLoadError

# GGUF value type id -> struct format of a fixed-size scalar.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_INLINE_ARRAY = 64  # longer arrays (tokenizer vocabularies) are recorded by length only


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str
    num_elements: int
    num_bytes: int


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    metadata: dict[str, object]
    array_lengths: dict[str, int]
    tensors: list[TensorInfo]


def read_gguf_header(path: str | Path) -> GGUFHeader:
    path = Path(path)
    try:
        with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _HeaderParser(data, path).parse()
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({exc})") from exc


class _HeaderParser:
    def __init__(self, data: mmap.mmap, path: Path):
        self.data = data
        self.path = path
        self.offset = 0

    def _unpack(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._unpack("<Q")
        raw = self.data[self.offset:self.offset + length]
        self.offset += length
        return raw.decode("utf-8", errors="replace")

    def _skip_strings(self, count: int) -> None:
        for _ in range(count):
            (length,) = struct.unpack_from("<Q", self.data, self.offset)
            self.offset += 8 + length

    def _value(self, value_type: int, key: str, array_lengths: dict[str, int]):
        if value_type in _SCALAR_FORMATS:
            return self._unpack(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ModelLoadError(f"{self.path}: unknown GGUF value type {value_type} for {key}")
        item_type = self._unpack("<I")
        count = self._unpack("<Q")
        array_lengths[key] = count
        if count <= _MAX_INLINE_ARRAY:
            return [self._value(item_type, key, {}) for _ in range(count)]
        if item_type == _STRING:
            self._skip_strings(count)
        elif item_type in _SCALAR_FORMATS:
            self.offset += count * struct.calcsize(_SCALAR_FORMATS[item_type])
        else:
            raise ModelLoadError(f"{self.path}: nested GGUF array in {key} is not supported")
        return None

    def parse(self) -> GGUFHeader:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        if self.data[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path}: missing GGUF magic bytes")
        self.offset = 4
        version = self._unpack("<I")
        if version < 2:
            raise ModelLoadError(f"{self.path}: GGUF version {version} is too old (need 2 or later)")
        num_tensors = self._unpack("<Q")
        num_fields = self._unpack("<Q")
        metadata: dict[str, object] = {}
        array_lengths: dict[str, int] = {}
        for _ in range(num_fields):
            key = self._string()
            metadata[key] = self._value(self._unpack("<I"), key, array_lengths)
        tensors = []
        for _ in range(num_tensors):
            name = self._string()
            num_dims = self._unpack("<I")
            shape = tuple(self._unpack("<Q") for _ in range(num_dims))
            type_id = self._unpack("<I")
            self._unpack("<Q")  # data offset: not needed for sizes
            try:
                quant_type = GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise ModelLoadError(f"{self.path}: tensor {name} has unknown type {type_id}") from exc
            block_size, bytes_per_block = GGML_QUANT_SIZES[quant_type]
            num_elements = 1
            for dim in shape:
                num_elements *= dim
            tensors.append(TensorInfo(name, shape, quant_type.name, num_elements,
                                      num_elements // block_size * bytes_per_block))
        return GGUFHeader(metadata, array_lengths, tensors)
