"""Quantized linear layers on the CPU kernels, for every GGML block type of a common GGUF file.

`--dtype auto` runs a GGUF file's tensors in the block types they are stored in (Q4_0, Q4_1, Q5_0,
Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), the file's own bytes regrouped once at load; `--dtype int4` converts
every linear weight to Q4_1 (fp16 scale and minimum per 32 weights, 5 bits per weight) and
`--dtype int8` to Q8_0 (8.5 bits per weight). The matrix product is C++ (cpu_kernels.cpp and its
headers: activations quantized to 8-bit blocks, integer dot products on AVX-512 VNNI or AVX2),
compiled once per machine with torch's extension builder into ~/.cache/tokios/kernels
(scripts/setup builds it; a first use builds it otherwise). Where it cannot be built, or off the
CPU, the weights are dequantized once and multiplied with torch (correct, slower);
`kernel_status()` says which path runs.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from tokios import load_progress
from tokios.model.blocks import unpack
from tokios.model_files import cache_directory
from tokios.model.quant import PackedWeight, SegmentedWeight, as_dense

logger = logging.getLogger("tokios.kernels")

BLOCK = 32
# Kernel format ids (cpu_kernels.cpp, blocks.h) by GGML type.
FORMAT_BY_TYPE = {T.Q4_1: 0, T.Q8_0: 1, T.Q4_0: 2, T.Q5_0: 3, T.Q5_1: 4, T.Q4_K: 5, T.Q5_K: 6, T.Q6_K: 7,
                  T.MXFP4: 8}
Q4_1, Q8_0 = FORMAT_BY_TYPE[T.Q4_1], FORMAT_BY_TYPE[T.Q8_0]
# --dtype conversions: the block type every linear weight is converted to.
TYPE_BY_DTYPE = {"int4": T.Q4_1, "int8": T.Q8_0}
_SOURCES = sorted(Path(__file__).parent.glob("*.[ch]*"))
_MAIN_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_extension = None
_extension_error: str | None = None


def _build_directory(variant: str = "") -> Path:
    sources = b"".join(path.read_bytes() for path in _SOURCES)
    digest = hashlib.sha256(sources + torch.__version__.encode() + variant.encode()).hexdigest()[:16]
    return cache_directory() / "kernels" / digest


def compile_kernels(name: str = "tokios_cpu_kernels", march: str = "native"):
    """Build (or reuse the cached build of) the C++ kernels for -march=`march`. The engine uses
    native; the tests also build a baseline x86-64-v2 one to check the portable scalar path."""
    from torch.utils.cpp_extension import load

    build_directory = _build_directory("" if march == "native" else march)
    build_directory.mkdir(parents=True, exist_ok=True)
    with load_progress.phase(_build_phase(build_directory, name, march)):
        return load(name=name, sources=[str(_MAIN_SOURCE)], build_directory=str(build_directory),
                    extra_cflags=["-O3", f"-march={march}", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def _build_phase(build_directory: Path, name: str, march: str) -> str:
    """What torch's extension builder is about to do, as a load's progress says it. The builder
    holds a lock file in the build directory while it builds or checks a build (its FileBaton,
    which records no process id); any other process waits for the file to go."""
    lock = build_directory / "lock"
    if lock.exists():
        return f"waiting for another process's build of the CPU kernels (its lock: {lock})"
    if any(build_directory.glob(f"{name}*.so")):
        return f"checking the cached build of the CPU kernels in {build_directory}"
    return f"building the CPU kernels ({_MAIN_SOURCE.name}, -march={march}; once per machine, about a minute)"


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


def has_vector_kernels(extension) -> bool:
    """Whether this build of the kernels has a vector path (AVX-512 VNNI or AVX2), not only the
    portable scalar loops."""
    return extension.has_vnni() or extension.has_avx2()


def kernel_status() -> str:
    extension = load_extension()
    if extension is None:
        return f"torch fallback ({_extension_error})"
    if extension.has_vnni():
        return "C++ kernel, AVX-512 VNNI" + (" and BF16" if extension.has_bf16_dot() else "")
    return "C++ kernel, AVX2" if extension.has_avx2() else "C++ kernel, portable scalar path"


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


def packed_groups(extension, raw: torch.Tensor, ggml_type: T, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A tensor's file blocks -> the kernel's groups of 16 features. shape: [out, in], or
    [num_experts, out, in] (a 3-D expert tensor, raw [num_experts * out, row_bytes]): packed
    expert after expert (experts.h)."""
    num_experts = shape[0] if len(shape) == 3 else 1
    ints = unpack(raw.numpy(), ggml_type, (num_experts * shape[-2], shape[-1]), name)

    def as_tensor(array):  # fp16 and int8 arrays travel as their bits (int16 / uint8)
        if array is None:
            return None
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16 if array.dtype.itemsize == 2 else np.uint8))

    scales = ints.scales
    if ggml_type == T.MXFP4:  # its power-of-two scales travel as bfloat16 bits (blocks.h), exact
        scales = (np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    arrays = [as_tensor(a) for a in (ints.values, scales, ints.minimums, ints.sub_scales, ints.sub_minimums)]
    if len(shape) == 3:
        return extension.pack_expert_ints(*arrays, FORMAT_BY_TYPE[ggml_type], num_experts)
    return extension.pack_ints(*arrays, FORMAT_BY_TYPE[ggml_type])


class QuantizedLinear:
    """y = x W^T + b with W in GGML blocks; activations and output float32.

    The weight's output features come in segments, each in its own block type (a file may store
    q, k and v, or gate and up, differently); `target_type` converts every segment to one type
    (--dtype int4 / int8), otherwise each runs as stored. With the C++ kernel the blocks are
    regrouped once at load (pack_ints: 16 output features interleaved per vector) and every row,
    decode or prefill, takes the same dot kernel, so a row's result never depends on the batch or
    on whether it was part of a prompt. In a build with neither AVX-512 VNNI nor AVX2, chunks of
    many rows are dequantized and multiplied with oneDNN in bfloat16 instead. Without the kernel
    (no compiler, or off the CPU) the weight is dequantized once and multiplied with torch.

    exact_sums: the kernel sums the input blocks exactly (quant_matmul.h, kSumGridBits), so the
    products of input-feature shards, added as partial_sums, are this product bit for bit: the
    layers tensor parallel splits by input features (o_proj, down) take it."""

    # Without vector kernels, from this many rows on a dequantized bf16 product beats the scalar loops.
    SCALAR_PATH_MAX_ROWS = 8

    def __init__(self, weight: "torch.Tensor | PackedWeight | SegmentedWeight", bias: torch.Tensor | None,
                 device: torch.device = torch.device("cpu"), precise_activations: bool = False,
                 target_type: T | None = None, exact_sums: bool = False):
        self.out_features, self.in_features = weight.shape
        self.precise_activations = precise_activations
        self.exact_sums = exact_sums
        if self.in_features % BLOCK:
            raise ValueError(f"in_features must be a multiple of {BLOCK}, got {self.in_features}")
        segments = weight.parts if isinstance(weight, SegmentedWeight) else [weight]
        if target_type is not None:
            segments = [part if isinstance(part, PackedWeight) and part.ggml_type == target_type
                        else _quantized(as_dense(part).cpu(), target_type, getattr(part, "name", "weight"),
                                        getattr(part, "num_tensors", 1))
                        for part in segments]
        elif not all(isinstance(part, PackedWeight) and part.ggml_type in FORMAT_BY_TYPE for part in segments):
            raise ValueError("a quantized linear runs as stored only from kernel block types")
        self.ggml_types = [part.ggml_type for part in segments]
        # One entry per file tensor held (q, k and v stacked in one segment count 3).
        self.tensor_types = [part.ggml_type for part in segments for _ in range(part.num_tensors)]
        self.bias = None if bias is None else bias.float().contiguous().to(device)
        self.extension = load_extension() if device.type == "cpu" else None
        if self.extension is not None:
            packed = [packed_groups(self.extension, part.raw, part.ggml_type, part.shape, part.name) for part in segments]
            self.formats = [FORMAT_BY_TYPE[part.ggml_type] for part in segments]
            self.segment_out_features = [part.shape[0] for part in segments]
            self.linear = self.extension.PackedLinear(packed, self.formats, self.segment_out_features,
                                                      self.in_features, precise_activations, self.bias,
                                                      exact_sums)
            self._packed = packed
            self.weight = None
            self._num_bytes = sum(p.numel() for p in packed)
        else:
            self.linear = None
            self.weight = torch.cat([part.dequantize() for part in segments]).to(device)
            self._num_bytes = sum(part.raw.numel() for part in segments)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if self.linear is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] > self.SCALAR_PATH_MAX_ROWS and not has_vector_kernels(self.extension):
            weight = self.dequantized_weight()
            out = F.linear(x.to(torch.bfloat16), weight.to(torch.bfloat16)).float()
            return out if self.bias is None else out + self.bias
        return self.linear(x.contiguous())

    def partial_sums(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] -> [M, out_features] float64: the product before its one rounding to
        float32, for a row-parallel shard (tensor parallel) whose group adds the shards' sums.
        Built with exact_sums and on the kernel, the sum over blocks is exact (quant_matmul.h,
        kSumGridBits), so the shards' sums rounded to float32 are the whole weight's product bit
        for bit; otherwise they are this shard's float32 product."""
        x = x.float()
        if (not self.exact_sums or self.linear is None
                or (x.shape[0] > self.SCALAR_PATH_MAX_ROWS and not has_vector_kernels(self.extension))):
            return self(x).double()
        return self.linear.partial_sums(x.contiguous())

    def dequantized_weight(self) -> torch.Tensor:
        """[out_features, in_features] float32: exactly the weights the kernel multiplies by."""
        if self.linear is None:
            return self.weight
        return torch.cat([self.extension.dequantize_packed(packed, fmt, part_out, self.in_features)
                          for packed, fmt, part_out in zip(self._packed, self.formats, self.segment_out_features)])

    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def weight_bytes_read(self) -> int | None:
        """The weight bytes the kernel's products have read so far (None off the kernel)."""
        return None if self.linear is None else self.linear.weight_bytes_read


def _quantized(weight: torch.Tensor, ggml_type: T, name: str, num_tensors: int) -> PackedWeight:
    blocks = quantize_q4_1(weight) if ggml_type == T.Q4_1 else quantize_q8_0(weight)
    return PackedWeight(blocks, ggml_type, tuple(weight.shape), name, num_tensors)


def make_quantized_linear(weight: "torch.Tensor | PackedWeight | SegmentedWeight", bias: torch.Tensor | None,
                          weight_format: str, device: torch.device = torch.device("cpu"),
                          precise_activations: bool = False, exact_sums: bool = False) -> QuantizedLinear:
    """weight_format: "int4" / "int8" (convert) or "stored" (each segment as the file has it)."""
    return QuantizedLinear(weight, bias, device, precise_activations, TYPE_BY_DTYPE.get(weight_format), exact_sums)


def precise_activations(model_dtype: str) -> bool:
    """Whether a model in this --dtype runs its kernels on precise (~15-bit) activations rather than
    8-bit ones (cpu_kernels.cpp, QuantizedActivations). int4 is the speed format and takes 8-bit,
    as llama.cpp does. int8 is the accuracy format, and its requantized weights leave no room for
    the 8-bit error: on the perplexity gate's text, int8 is 1.21% from transformers float32 with
    8-bit activations (the gate is 1%), against 0.68% with float ones; int4 with 8-bit is 0.60%."""
    return model_dtype == "int8"

