"""Float weights -> GGML blocks of any type the kernels run, with our own round-to-nearest
quantizers (numpy), and MXFP4 as llama.cpp writes it (blocks/mxfp4.py). They make the test files: the default model and random-weight models
written in Q4_0 ... Q6_K, so tests never depend on llama.cpp being built. Valid blocks, not
llama.cpp's error-minimising search: the tests compare the engine against the same file's
own weights, so the quantizer's quality does not enter the comparison.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

from tokios.model.blocks.codec import BLOCK, SUPER_BLOCK, BlockInts, pack, unpack
from tokios.model.blocks.mxfp4 import quantize_mxfp4

K_QUANT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def _half(values: np.ndarray) -> np.ndarray:
    # fp16 as stored, clamped into its finite range
    return np.clip(values, -65504.0, 65504.0).astype(np.float16)


def _inverse(scale: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale != 0, 1.0 / scale, 0.0).astype(np.float32)


def _signed_extreme(groups: np.ndarray) -> np.ndarray:
    # the value of largest magnitude, with its sign (llama.cpp's choice for symmetric types)
    index = np.abs(groups).argmax(axis=-1)[..., None]
    return np.take_along_axis(groups, index, axis=-1)[..., 0]


def _legacy(weight: np.ndarray, ggml_type: T) -> BlockInts:
    n, k = weight.shape
    groups = weight.reshape(n, k // BLOCK, BLOCK)
    if ggml_type in (T.Q4_1, T.Q5_1):
        levels = 15 if ggml_type == T.Q4_1 else 31
        low = groups.min(axis=-1)
        scales = _half((groups.max(axis=-1) - low) / levels)
        minimums = _half(-low)
        u = np.rint((groups + minimums.astype(np.float32)[..., None]) * _inverse(scales.astype(np.float32))[..., None])
        return BlockInts(ggml_type, np.clip(u, 0, levels).astype(np.uint8).reshape(n, k), scales, minimums, None, None)
    if ggml_type == T.Q8_0:
        scales = _half(np.abs(groups).max(axis=-1) / 127)
        q = np.rint(groups * _inverse(scales.astype(np.float32))[..., None])
        return BlockInts(ggml_type, (np.clip(q, -127, 127) + 128).astype(np.uint8).reshape(n, k), scales, None, None, None)
    zero = 8 if ggml_type == T.Q4_0 else 16
    scales = _half(_signed_extreme(groups) / -zero)
    u = np.rint(groups * _inverse(scales.astype(np.float32))[..., None]) + zero
    return BlockInts(ggml_type, np.clip(u, 0, 2 * zero - 1).astype(np.uint8).reshape(n, k), scales, None, None, None)


def _k_quant(weight: np.ndarray, ggml_type: T) -> BlockInts:
    n, k = weight.shape
    num_super = k // SUPER_BLOCK
    if ggml_type == T.Q6_K:
        groups = weight.reshape(n, num_super, 16, 16)
        group_scales = _signed_extreme(groups) / -32
        scales = _half(np.abs(group_scales).max(axis=-1) / 127)
        sub = np.clip(np.rint(group_scales * _inverse(scales.astype(np.float32))[..., None]), -128, 127)
        step = scales.astype(np.float32)[..., None] * sub
        u = np.clip(np.rint(groups * _inverse(step)[..., None]) + 32, 0, 63)
        return BlockInts(ggml_type, u.astype(np.uint8).reshape(n, k), scales, None,
                         sub.astype(np.int8).reshape(n, k // 16), None)
    levels = 15 if ggml_type == T.Q4_K else 31
    groups = weight.reshape(n, num_super, 8, BLOCK)
    low = np.minimum(groups.min(axis=-1), 0)           # K-quants subtract a non-negative minimum
    group_scales = (groups.max(axis=-1) - low) / levels
    scales = _half(group_scales.max(axis=-1) / 63)
    minimums = _half((-low).max(axis=-1) / 63)
    sub = np.clip(np.rint(group_scales * _inverse(scales.astype(np.float32))[..., None]), 0, 63)
    sub_min = np.clip(np.rint(-low * _inverse(minimums.astype(np.float32))[..., None]), 0, 63)
    step = scales.astype(np.float32)[..., None] * sub
    offset = minimums.astype(np.float32)[..., None] * sub_min
    u = np.clip(np.rint((groups + offset[..., None]) * _inverse(step)[..., None]), 0, levels)
    return BlockInts(ggml_type, u.astype(np.uint8).reshape(n, k), scales, minimums,
                     sub.astype(np.uint8).reshape(n, k // BLOCK), sub_min.astype(np.uint8).reshape(n, k // BLOCK))


def quantize_ints(weight: np.ndarray, ggml_type: T) -> BlockInts:
    """[N, K] float -> BlockInts of `ggml_type` (K a multiple of 32, or of 256 for K-quants)."""
    weight = np.asarray(weight, dtype=np.float32)
    if weight.ndim != 2:
        raise ValueError(f"quantize takes a 2-D weight, got shape {weight.shape}")
    multiple = SUPER_BLOCK if ggml_type in K_QUANT_TYPES else BLOCK
    if weight.shape[1] % multiple:
        raise ValueError(f"{ggml_type.name} needs rows that are a multiple of {multiple}, got {weight.shape[1]}")
    if ggml_type == T.MXFP4:  # llama.cpp's own choice of exponent and codes (blocks/mxfp4.py)
        return unpack(quantize_mxfp4(weight), T.MXFP4, weight.shape)
    return _k_quant(weight, ggml_type) if ggml_type in K_QUANT_TYPES else _legacy(weight, ggml_type)


def quantize(weight: np.ndarray, ggml_type: T) -> np.ndarray:
    """[N, K] float -> the flat GGUF bytes of that tensor in `ggml_type`."""
    if ggml_type == T.MXFP4:
        return quantize_mxfp4(weight)
    return pack(quantize_ints(weight, ggml_type))
