"""Dequantization of GGUF tensor types into float32 torch tensors.

The `gguf` package's numpy implementation does the unpacking (measured here: the whole default
model in ~0.9 s, faster than a hand-written torch version on 2 cores). This module owns the list
of supported types and turns an unknown one into an UnsupportedError naming it.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from tokios.errors import UnsupportedError

SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})


def dequantize(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...], name: str = "tensor") -> torch.Tensor:
    """Bytes of one GGUF tensor -> float32 tensor of `shape` (PyTorch order)."""
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(f"tensor {name} has type {ggml_type.name}, which tokios does not support "
                               f"(supported: {supported})")
    values = np.ascontiguousarray(gguf_quants.dequantize(raw, ggml_type), dtype=np.float32)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only mapped file
        values = values.copy()
    return torch.from_numpy(values).reshape(shape)


# Block types that the quantized kernels read as they are stored in the file.
PACKABLE_TYPES = frozenset({T.Q4_1, T.Q8_0})


class PackedWeight:
    """A 2-D weight still in its file's block format: one row of GGML blocks per output feature.

    Kept packed so that a quantized model can use the file's own bytes (no dequantize and
    requantize at load: faster, and exactly the weights the file holds); dense formats call
    dequantize(). Row operations (concatenation, reordering) work on the packed rows directly.
    """

    def __init__(self, raw: torch.Tensor, ggml_type: T, shape: tuple[int, int], name: str = "tensor"):
        self.raw = raw  # [out_features, row_bytes] uint8
        self.ggml_type = ggml_type
        self.shape = tuple(shape)
        self.name = name

    @classmethod
    def from_file(cls, raw: np.ndarray, ggml_type: T, shape: tuple[int, ...], name: str) -> "PackedWeight":
        rows = torch.from_numpy(raw.copy()).reshape(shape[0], -1)  # copy: the mapped file is read-only
        return cls(rows, ggml_type, shape, name)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw.numpy().reshape(-1), self.ggml_type, self.shape, self.name)

    def with_rows(self, raw: torch.Tensor) -> "PackedWeight":
        return PackedWeight(raw, self.ggml_type, (raw.shape[0], self.shape[1]), self.name)


def concat_rows(weights: list["torch.Tensor | PackedWeight"]) -> "torch.Tensor | PackedWeight":
    """Stack weights along output features, staying packed when every part shares one type."""
    if all(isinstance(w, PackedWeight) for w in weights) and len({w.ggml_type for w in weights}) == 1:
        return weights[0].with_rows(torch.cat([w.raw for w in weights]))
    return torch.cat([w.dequantize() if isinstance(w, PackedWeight) else w for w in weights])


def as_dense(weight: "torch.Tensor | PackedWeight") -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, PackedWeight) else weight
