"""GGUF tensors as the model layer holds them: dequantized into float32 torch tensors, or kept
in their file's blocks (PackedWeight, SegmentedWeight) for the quantized kernels.

The `gguf` package's numpy implementation does the dequantizing (measured here: the whole default
model in ~0.9 s, faster than a hand-written torch version on 2 cores). This module owns the list
of supported types and turns an unknown one, or bytes that do not fit the shape, into an error
naming the tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import quants as gguf_quants

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.blocks import KERNEL_TYPES, check_shape

SUPPORTED_TYPES = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
                             T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4})


def dequantize(raw: np.ndarray, ggml_type: T, shape: tuple[int, ...], name: str = "tensor") -> torch.Tensor:
    """Bytes of one GGUF tensor -> float32 tensor of `shape` (PyTorch order)."""
    if ggml_type not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise UnsupportedError(f"tensor {name} has type {ggml_type.name}, which tokios does not support "
                               f"(supported: {supported})")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    num_elements = int(np.prod(shape))
    if num_elements % block_size or raw.size != num_elements // block_size * type_size:
        raise ModelLoadError(f"tensor {name} ({ggml_type.name}, shape {'x'.join(map(str, shape))}): {raw.size} bytes, "
                             f"but that shape needs {num_elements / block_size * type_size:g}")
    values = np.ascontiguousarray(gguf_quants.dequantize(raw, ggml_type), dtype=np.float32)
    if not values.flags.writeable:  # F32 comes back as a view of the read-only mapped file
        values = values.copy()
    return torch.from_numpy(values).reshape(shape)


# Block types that the quantized kernels read as they are stored in the file.
PACKABLE_TYPES = KERNEL_TYPES


class PackedWeight:
    """A 2-D weight still in its file's block format: one row of GGML blocks per output feature.

    Kept packed so that a quantized model can use the file's own bytes (no dequantize and
    requantize at load: faster, and exactly the weights the file holds); dense formats call
    dequantize(). Row operations (concatenation, reordering) work on the packed rows directly.
    """

    def __init__(self, raw: torch.Tensor, ggml_type: T, shape: tuple[int, int], name: str = "tensor",
                 num_tensors: int = 1):
        self.raw = raw  # [out_features, row_bytes] uint8
        self.ggml_type = ggml_type
        self.shape = tuple(shape)
        self.name = name
        self.num_tensors = num_tensors  # file tensors stacked in here (q, k and v: 3)

    @classmethod
    def from_file(cls, raw: np.ndarray, ggml_type: T, shape: tuple[int, ...], name: str) -> "PackedWeight":
        try:
            check_shape(ggml_type, raw.size, tuple(shape), name)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from None
        rows = torch.from_numpy(raw.copy()).reshape(shape[0], -1)  # copy: the mapped file is read-only
        return cls(rows, ggml_type, shape, name)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.raw.numpy().reshape(-1), self.ggml_type, self.shape, self.name)

    def with_rows(self, raw: torch.Tensor, num_tensors: int | None = None) -> "PackedWeight":
        return PackedWeight(raw, self.ggml_type, (raw.shape[0], self.shape[1]), self.name,
                            self.num_tensors if num_tensors is None else num_tensors)


class SegmentedWeight:
    """Packed weights stacked along output features, each part in its own block type (a file may
    store q, k and v, or gate and up, in different types): one linear layer, run part by part."""

    def __init__(self, parts: list[PackedWeight]):
        self.parts = parts
        self.shape = (sum(part.shape[0] for part in parts), parts[0].shape[1])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([part.dequantize() for part in self.parts])


def concat_rows(weights: list["torch.Tensor | PackedWeight"]) -> "torch.Tensor | PackedWeight | SegmentedWeight":
    """Stack weights along output features, staying packed when every part is packed (one
    PackedWeight per run of parts that share a type)."""
    if not all(isinstance(w, PackedWeight) for w in weights):
        return torch.cat([as_dense(w) for w in weights])
    runs: list[PackedWeight] = []
    for weight in weights:
        if runs and runs[-1].ggml_type == weight.ggml_type:
            runs[-1] = runs[-1].with_rows(torch.cat([runs[-1].raw, weight.raw]),
                                          runs[-1].num_tensors + weight.num_tensors)
        else:
            runs.append(weight)
    return runs[0] if len(runs) == 1 else SegmentedWeight(runs)


def select_rows(weight: "torch.Tensor | PackedWeight", rows: "slice | torch.Tensor") -> "torch.Tensor | PackedWeight":
    """Some output features of a weight (a range, or indices in any order), staying packed when it is."""
    if isinstance(weight, PackedWeight):
        return weight.with_rows(weight.raw[rows].contiguous())
    return weight[rows].contiguous()


def as_dense(weight: "torch.Tensor | PackedWeight | SegmentedWeight") -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()


class EmbeddingTable:
    """Rows gathered by token id, from a dense table or still in the file's blocks. Packed, only
    the rows a step asks for are dequantized: Gemma 3's 262,144 x 640 table is 178 MB as stored
    Q8_0 and would be 671 MB as float32 (the tied output head reads the same bytes as stored)."""

    def __init__(self, weight: "torch.Tensor | PackedWeight", dtype: torch.dtype, device: torch.device):
        self.packed = weight if isinstance(weight, PackedWeight) and device.type == "cpu" else None
        self.dense = None if self.packed is not None else as_dense(weight).to(device=device, dtype=dtype)
        self.dtype = dtype
        self.num_rows, self.dim = weight.shape

    def __call__(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            return self.dense[token_ids]
        rows = self.packed.raw[token_ids]
        return dequantize(rows.numpy().reshape(-1), self.packed.ggml_type, (len(token_ids), self.dim),
                          self.packed.name).to(self.dtype)
