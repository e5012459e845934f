"""Quantized weight formats and their CPU kernels.

`--dtype int4` holds linear weights in GGML's Q4_1 blocks (fp16 scale and minimum per 32
weights, 4-bit values: 5 bits per weight), `--dtype int8` in Q8_0 blocks (fp16 scale per 32,
8-bit values: 8.5 bits per weight). The matrix product is a C++ kernel (cpu_kernels.cpp:
activations quantized to 8-bit blocks, AVX-512 VNNI dot products), compiled once per machine
with torch's extension builder into ~/.cache/tokios/kernels (scripts/setup builds it; a first
use builds it otherwise). Where it cannot be built, or off the CPU, the same blocks are
dequantized and multiplied with torch (correct, slower); `kernel_status()` says which path runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from tokios.model.quant import PackedWeight, as_dense

logger = logging.getLogger("tokios.kernels")

BLOCK = 32
Q4_1, Q8_0 = 0, 1
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}
_GGML_TYPE = {Q4_1: GGMLQuantizationType.Q4_1, Q8_0: GGMLQuantizationType.Q8_0}
FORMAT_BY_DTYPE = {"int4": Q4_1, "int8": Q8_0}
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_extension = None
_extension_error: str | None = None


def _build_directory(variant: str = "") -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + variant.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TOKIOS_CACHE_DIR", Path.home() / ".cache" / "tokios"))
    return root / "kernels" / digest


def compile_kernels(name: str = "tokios_cpu_kernels", march: str = "native"):
    """Build (or reuse the cached build of) the C++ kernels for -march=`march`. The engine uses
    native; the tests also build a baseline x86-64-v2 one to check the portable scalar path."""
    from torch.utils.cpp_extension import load

    build_directory = _build_directory("" if march == "native" else march)
    build_directory.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(_SOURCE)], build_directory=str(build_directory),
                extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def load_extension():
    """The compiled kernel module, or None (with the reason in kernel_status()) if unavailable."""
    global _extension, _extension_error
    if _extension is not None or _extension_error is not None:
        return _extension
    try:
        _extension = compile_kernels()
    except Exception as exc:  # no compiler, no headers: fall back to torch, say so once
        _extension_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("quantized CPU kernel unavailable (%s); using the slower torch path", _extension_error)
    return _extension


def kernel_status() -> str:
    extension = load_extension()
    if extension is None:
        return f"torch fallback ({_extension_error})"
    return "C++ kernel, AVX-512 VNNI" if extension.has_vnni() else "C++ kernel, portable scalar path"


# ---- quantization into GGML blocks (torch, at load time) ------------------------------------------
def _halves_as_bytes(values: torch.Tensor) -> torch.Tensor:
    # [N, num_blocks] float -> [N, num_blocks, 2] uint8 (little-endian fp16)
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32*34] uint8 Q8_0 blocks (scale = max |w| / 127, as llama.cpp)."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    values = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([_halves_as_bytes(scale), values.view(torch.uint8)], dim=-1).reshape(n, -1)


def quantize_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32*20] uint8 Q4_1 blocks (scale = (max - min) / 15, minimum = min).
    A weight that was Q4_1 in the file comes back to the same 16 levels per block."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // BLOCK, BLOCK)
    minimum = blocks.amin(dim=-1)
    scale = (blocks.amax(dim=-1) - minimum) / 15.0
    # Quantize against the fp16-rounded scale and minimum that the kernel will read back.
    scale16, minimum16 = scale.half().float(), minimum.half().float()
    inverse = torch.where(scale16 > 0, 1.0 / scale16, torch.zeros_like(scale16))
    values = torch.round((blocks - minimum16[..., None]) * inverse[..., None]).clamp(0, 15).to(torch.uint8)
    packed = values[..., :16] | (values[..., 16:] << 4)
    return torch.cat([_halves_as_bytes(scale), _halves_as_bytes(minimum), packed], dim=-1).reshape(n, -1)


def dequantize_blocks(blocks: torch.Tensor, block_format: int, in_features: int) -> torch.Tensor:
    """Inverse of the quantizers: uint8 blocks -> [N, K] float32 (the torch fallback path)."""
    n = blocks.shape[0]
    num_blocks = in_features // BLOCK
    raw = blocks.reshape(n, num_blocks, BLOCK_BYTES[block_format])
    scale = raw[..., 0:2].contiguous().view(torch.float16).float()  # [N, num_blocks, 1]
    if block_format == Q8_0:
        values = raw[..., 2:].contiguous().view(torch.int8).float()
        return (values * scale).reshape(n, in_features)
    minimum = raw[..., 2:4].contiguous().view(torch.float16).float()
    packed = raw[..., 4:]
    values = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    return (values * scale + minimum).reshape(n, in_features)


def dequantize_packed(packed: torch.Tensor, block_format: int, out_features: int, in_features: int) -> torch.Tensor:
    """The kernel's packed groups (cpu_kernels.cpp, GroupLayout) -> [N, K] float32, the same
    values dequantize_blocks gives for the blocks they were packed from."""
    num_blocks = in_features // BLOCK
    num_groups = packed.shape[0]
    value_bytes, num_halves = (256, 32) if block_format == Q4_1 else (512, 16)
    values = packed[:, :num_blocks * value_bytes].reshape(num_groups, num_blocks, value_bytes // 64, 16, 4)
    halves = packed[:, num_blocks * value_bytes:num_blocks * (value_bytes + 2 * num_halves)].contiguous()
    halves = halves.view(torch.float16).float().reshape(num_groups, num_blocks, num_halves // 16, 16)
    scale = halves[:, :, 0].transpose(1, 2)[..., None]  # [groups, 16 features, blocks, 1]
    lanes = values.permute(0, 3, 1, 2, 4)  # [groups, 16 features, blocks, vectors, 4]
    if block_format == Q8_0:
        weights = (lanes.reshape(num_groups, 16, num_blocks, BLOCK).to(torch.int16) - 128).float() * scale
    else:
        nibbles = lanes.reshape(num_groups, 16, num_blocks, 16)
        weights = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float() * scale
        weights += halves[:, :, 1].transpose(1, 2)[..., None]
    return weights.reshape(num_groups * 16, in_features)[:out_features]


class QuantizedLinear:
    """y = x W^T + b with W in GGML blocks; activations and output float32.

    With the C++ kernel the blocks are regrouped once at load (pack_weight: 16 output features
    interleaved per vector, same bytes) and every row, decode or prefill, takes the same dot
    kernel (8-bit activations, or two planes when precise), so a row's result never depends on
    the batch or on whether it was part of a prompt. Where the kernel was built without AVX-512
    VNNI its scalar loops serve decode, and chunks of many rows are dequantized and multiplied
    with oneDNN in bfloat16 instead. Without the kernel (no compiler, or off the CPU) the file's
    blocks are kept and dequantized per call."""

    # Without VNNI, from this many rows on a dequantized bf16 product beats the scalar loops.
    SCALAR_PATH_MAX_ROWS = 8

    def __init__(self, weight: "torch.Tensor | PackedWeight", bias: torch.Tensor | None, block_format: int,
                 device: torch.device = torch.device("cpu"), precise_activations: bool = False):
        self.out_features, self.in_features = weight.shape
        self.precise_activations = precise_activations
        if self.in_features % BLOCK:
            raise ValueError(f"in_features must be a multiple of {BLOCK}, got {self.in_features}")
        self.block_format = block_format
        if isinstance(weight, PackedWeight) and weight.ggml_type == _GGML_TYPE[block_format]:
            blocks = weight.raw  # the file's own blocks, bit for bit
        else:
            quantize = quantize_q4_1 if block_format == Q4_1 else quantize_q8_0
            blocks = quantize(as_dense(weight).cpu())
        self.bias = None if bias is None else bias.float().contiguous().to(device)
        self.extension = load_extension() if device.type == "cpu" else None
        if self.extension is not None:
            self.packed = self.extension.pack_weight(blocks.contiguous(), block_format, self.in_features)
            self.blocks = None
        else:
            self.packed = None
            self.blocks = blocks.contiguous().to(device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.extension is None:
            weight = dequantize_blocks(self.blocks, self.block_format, self.in_features)
            return F.linear(x, weight, self.bias)
        if x.shape[0] > self.SCALAR_PATH_MAX_ROWS and not self.extension.has_vnni():
            weight = dequantize_packed(self.packed, self.block_format, self.out_features, self.in_features)
            out = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
            return out if self.bias is None else out + self.bias
        return self.extension.quant_linear(x.contiguous(), self.packed, self.block_format, self.out_features,
                                           self.precise_activations, self.bias)

    def num_bytes(self) -> int:
        return (self.packed if self.blocks is None else self.blocks).numel()


def make_quantized_linear(weight: "torch.Tensor | PackedWeight", bias: torch.Tensor | None, weight_format: str,
                          device: torch.device = torch.device("cpu"),
                          precise_activations: bool = False) -> QuantizedLinear:
    return QuantizedLinear(weight, bias, FORMAT_BY_DTYPE[weight_format], device, precise_activations)


def precise_activations(model_dtype: str) -> bool:
    """Whether a model in this --dtype runs its kernels on precise (~15-bit) activations rather than
    8-bit ones (cpu_kernels.cpp, QuantizedActivations). int4 is the speed format and takes 8-bit,
    as llama.cpp does. int8 is the accuracy format, and its requantized weights leave no room for
    the 8-bit error: on the perplexity gate's text, int8 was 1.21% from transformers float32 with
    8-bit activations (gate 1%), against 0.68% with float ones; int4 was 0.60%."""
    return model_dtype == "int8"

