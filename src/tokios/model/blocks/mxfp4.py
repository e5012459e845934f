"""MXFP4 (GGML type 39; OCP microscaling FP4, gpt-oss's expert weights): our quantizer, writing
the bytes llama.cpp's quantize_row_mxfp4_ref writes (ggml-quants.c), which is what
llama-quantize's MXFP4_MOE stores.

A block is 32 weights in 17 bytes: one E8M0 exponent byte e, then 16 bytes of 4-bit E2M1 codes,
weight j in the low nibble of byte j and weight j + 16 in the high one. A code indexes
E2M1_DOUBLED (the E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives, doubled to be
integers) and the weight is that value times 2^(e - 128) (ggml's e8m0_to_fp32_half: half the
scale, for the doubling). The values are not evenly spaced, so MXFP4 has no integer form in
blocks/codec.py (scale * (u - zero)); the kernels do not run it, and the loader dequantizes it
(the gguf package's MXFP4 dequantizer computes what llama.cpp's does).

The choice, as llama.cpp makes it: e = floor(log2(absmax)) - 2 + 127 (so the block's largest
weight lands in [4, 8) halves of the scale, the top of the E2M1 range 6 being reached by
rounding), e = 0 for an all-zero block; each weight takes the code whose value is nearest,
the first in table order on a tie (so +0 before -0). All arithmetic in float32 as the C code
does. Exponents below 0 (absmax under 2^-125) are undefined behaviour in C (a negative float
cast to uint8); here they are clamped to 0.
"""

from __future__ import annotations

import numpy as np

BLOCK = 32
BLOCK_BYTES = 17
E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
# Blocks quantized at a time: the nearest-code search holds [blocks, 32, 16] float32 (32 MiB).
_CHUNK_BLOCKS = 16384


def half_scales(exponents: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> 2^(e - 128) as float32 (e 0 and 1: the subnormals 2^-128, 2^-127)."""
    exponents = exponents.astype(np.uint32)
    bits = np.where(exponents < 2, np.uint32(0x00200000) << exponents, (exponents - 1) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)


def quantize_mxfp4(weight: np.ndarray) -> np.ndarray:
    """[..., K] float (K a multiple of 32) -> the flat MXFP4 bytes of those rows."""
    weight = np.asarray(weight, dtype=np.float32)
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs rows that are a multiple of {BLOCK}, got {weight.shape[-1]}")
    blocks = weight.reshape(-1, BLOCK)
    out = np.empty((blocks.shape[0], BLOCK_BYTES), dtype=np.uint8)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start:start + _CHUNK_BLOCKS]
        absmax = np.abs(chunk).max(axis=1)
        with np.errstate(divide="ignore"):
            exponent = np.floor(np.log2(absmax)) - np.float32(2) + np.float32(127)
        exponents = np.where(absmax > 0, np.clip(exponent, 0, 255), 0).astype(np.uint8)
        scale = half_scales(exponents)
        # |code value * scale - weight| for every code: [blocks, 32, 16], the first minimum wins
        errors = np.abs(E2M1_DOUBLED[None, None, :] * scale[:, None, None] - chunk[:, :, None])
        codes = errors.argmin(axis=2).astype(np.uint8)
        out[start:start + len(chunk), 0] = exponents
        out[start:start + len(chunk), 1:] = codes[:, :16] | (codes[:, 16:] << 4)
    return out.reshape(-1)
