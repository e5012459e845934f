"""Linear layers in the weight formats `--dtype` offers.

A model file describes the maths with `make_linear(weight, bias, weight_format)`; the format
decides how the weight is held and multiplied. Dense float32/bfloat16 use PyTorch's matmul
(oneDNN/MKL on CPU, cuBLAS on GPU); quantized formats live in model/kernels/.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokios.errors import InvalidRequestError
from tokios.model.quant import PackedWeight, SegmentedWeight, as_dense


class DenseLinear:
    """y = x W^T + b with W held in `dtype` (float32 or bfloat16), y in `output_dtype` (default
    `dtype`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                 output_dtype: torch.dtype | None = None):
        self.weight = weight.to(dtype).contiguous()  # [out_features, in_features]
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features, self.in_features = self.weight.shape
        self.output_dtype = output_dtype or dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(self.output_dtype)

    def num_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def make_linear(weight: "torch.Tensor | PackedWeight | SegmentedWeight", bias: torch.Tensor | None,
                weight_format: str, device: torch.device, precise_activations: bool = False,
                exact_sums: bool = False):
    """weight: [out_features, in_features] on the CPU, dense (float32, or the dtype of a dense
    file tensor) or still packed as in the file. weight_format "stored" runs it as the file has
    it: packed blocks on the quantized kernels; dense bfloat16 in bfloat16; float16 and float32
    (and the types without a kernel, dequantized exactly) in float32.
    precise_activations: for quantized formats, the model's activation precision (model/kernels).
    exact_sums: for quantized formats, sum the input blocks exactly, so that tensor parallel's
    input-feature shards add up to this product bit for bit (the layers it splits so: o_proj,
    down); it costs those products 16-22% more time on AVX2."""
    bias = None if bias is None else bias.to(device)
    is_packed = isinstance(weight, (PackedWeight, SegmentedWeight))
    if weight_format in ("int8", "int4") or (weight_format == "stored" and is_packed):
        from tokios.model.kernels import make_quantized_linear

        return make_quantized_linear(weight, bias, weight_format, device, precise_activations, exact_sums)
    if weight_format == "stored":
        # Activations stay float32 as for the quantized kernels (the C++ ops take them so, and
        # a file mixes dense and packed tensors); a bfloat16 tensor multiplies in bfloat16.
        dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
        return DenseLinear(weight.to(device), bias, dtype, output_dtype=torch.float32)
    weight = as_dense(weight).to(device)
    if weight_format == "float32":
        return DenseLinear(weight, bias, torch.float32)
    if weight_format == "bfloat16":
        return DenseLinear(weight, bias, torch.bfloat16)
    raise InvalidRequestError(f"dtype must be one of auto, float32, bfloat16, int8, int4, got {weight_format!r}",
                              param="dtype")


def summarize_linears(linears: list) -> str:
    """What runs, for the start-up log: the file's linear tensors per block type (or dense dtype;
    stacked projections count one per tensor) and their bytes."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for linear in linears:
        types = getattr(linear, "tensor_types", None)
        if types:
            counts.update(t.name for t in types)
        elif isinstance(linear, torch.nn.Module):  # the sparse MoE: its router's and experts' tensors
            counts.update(str(tensor.dtype).removeprefix("torch.") for tensor in linear.buffers())
        else:
            counts.update([str(linear.weight.dtype).removeprefix("torch.")])
    kinds = ", ".join(f"{name} {count}" for name, count in sorted(counts.items(), key=lambda item: -item[1]))
    return f"{kinds}; {sum(linear.num_bytes() for linear in linears) / 2**20:.1f} MiB of linear weights"
