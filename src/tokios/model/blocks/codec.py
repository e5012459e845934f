"""GGML block bytes <-> their integer form (BlockInts), for every type the kernels run.

Every block type of a common GGUF file stores w = scale * (u - zero) + minimum with small
unsigned integers u; they differ in bit width, where the scales live and how the bits are laid
out. BlockInts is that shared form, one row per output feature:

    w[n, k] = scale[n, k // S] * sub_scale[n, k // s] * (u[n, k] - zero)
              - minimum[n, k // S] * sub_minimum[n, k // 32]

with S the scale group (32 for the legacy types, the 256-weight super-block for K-quants) and
s the sub-scale group (32, or 16 for Q6_K); legacy types have no sub-scales and add their
minimum (stored negated here so that one sign serves both). MXFP4 fits the same form with
u = its E2M1 code's value doubled plus 12 (MXFP4_VALUES; zero 12) and a float32 scale
2^(e - 128) for the block's exponent byte e (float16 cannot hold every such power of two). The kernel packer
(cpu_kernels.cpp, pack_ints) and the torch fallback read this form; `pack` is `unpack`'s exact
inverse, so the test quantizers (blocks/quantize.py) write real GGUF blocks through it.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

BLOCK = 32
SUPER_BLOCK = 256

# type -> (bits of u, zero, has a minimum, sub-scale group: 0 none, else weights per sub-scale)
LAYOUTS = {
    T.Q4_0: (4, 8, False, 0), T.Q4_1: (4, 0, True, 0), T.Q5_0: (5, 16, False, 0), T.Q5_1: (5, 0, True, 0),
    T.Q8_0: (8, 128, False, 0), T.Q4_K: (4, 0, True, 32), T.Q5_K: (5, 0, True, 32), T.Q6_K: (6, 32, False, 16),
    T.MXFP4: (4, 12, False, 0),
}
BLOCK_BYTES = {T.Q4_0: 18, T.Q4_1: 20, T.Q5_0: 22, T.Q5_1: 24, T.Q8_0: 34, T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210,
               T.MXFP4: 17}
# MXFP4 code -> u (E2M1's 0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives, doubled, plus 12: the kernel's
# kMxfp4Values), and back (the first code of a value: +0 for zero; 255 where no code gives u).
MXFP4_VALUES = np.array([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=np.uint8)
MXFP4_CODES = np.full(256, 255, dtype=np.uint8)
MXFP4_CODES[MXFP4_VALUES[::-1]] = np.arange(15, -1, -1, dtype=np.uint8)


@dataclass
class BlockInts:
    ggml_type: T
    values: np.ndarray                 # [N, K] uint8: u
    scales: np.ndarray                 # [N, K / S] float16 (MXFP4: float32)
    minimums: np.ndarray | None        # [N, K / S] float16 (subtracted), or None
    sub_scales: np.ndarray | None      # [N, K / s] uint8 (Q4_K, Q5_K) or int8 (Q6_K), or None
    sub_minimums: np.ndarray | None    # [N, K / 32] uint8 (Q4_K, Q5_K), or None

    @property
    def zero(self) -> int:
        return LAYOUTS[self.ggml_type][1]

    def dequantize(self) -> np.ndarray:
        """[N, K] float32, computed as the gguf package does (scale products first, in float32)."""
        n, k = self.values.shape
        u = self.values.astype(np.float32) - np.float32(self.zero)
        scale = np.repeat(self.scales.astype(np.float32), k // self.scales.shape[1], axis=1)
        if self.sub_scales is not None:
            scale = scale * np.repeat(self.sub_scales.astype(np.float32), k // self.sub_scales.shape[1], axis=1)
        out = scale * u
        if self.minimums is not None:
            minimum = np.repeat(self.minimums.astype(np.float32), k // self.minimums.shape[1], axis=1)
            if self.sub_minimums is not None:
                minimum = minimum * np.repeat(self.sub_minimums.astype(np.float32), BLOCK, axis=1)
            out = out - minimum
        return out


def check_shape(ggml_type: T, num_bytes: int, shape: tuple[int, ...], name: str) -> None:
    """Raise ValueError naming the tensor if its bytes cannot be `shape` in `ggml_type`: rows of
    k weights, (n, k), or a stack of them (num_experts, n, k)."""
    *outer, k = shape
    n = math.prod(outer)
    dims = "x".join(map(str, shape))
    weights_per_block = SUPER_BLOCK if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else BLOCK
    if k % weights_per_block:
        raise ValueError(f"tensor {name} ({ggml_type.name}, shape {dims}): rows of {k} weights are not a "
                         f"whole number of {weights_per_block}-weight blocks")
    expected = n * k // weights_per_block * BLOCK_BYTES[ggml_type]
    if num_bytes != expected:
        raise ValueError(f"tensor {name} ({ggml_type.name}, shape {dims}): {num_bytes} bytes, but that shape "
                         f"needs {expected}")


def _halves(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # [..., 12] -> 8 six-bit scales and 8 six-bit minimums (Q4_K / Q5_K)
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=-1)
    minimums = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, minimums


def _pack_k_scales(scales: np.ndarray, minimums: np.ndarray) -> np.ndarray:
    low = (scales[..., :4] & 63) | ((scales[..., 4:] >> 4) << 6)
    high = (minimums[..., :4] & 63) | ((minimums[..., 4:] >> 4) << 6)
    mixed = (scales[..., 4:] & 15) | ((minimums[..., 4:] & 15) << 4)
    return np.concatenate([low, high, mixed], axis=-1).astype(np.uint8)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    # legacy [..., 16] bytes -> [..., 32]: element j in the low nibble of byte j, j + 16 in the high
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(word: np.ndarray, count: int) -> np.ndarray:
    # [..., 4] little-endian bytes -> [..., count] single bits, bit i of the 32-bit word first
    return (np.unpackbits(word, axis=-1, bitorder="little")[..., :count]).astype(np.uint8)


def unpack(raw: np.ndarray, ggml_type: T, shape: tuple[int, int], name: str = "tensor") -> BlockInts:
    """Bytes of a 2-D tensor [N, K] in `ggml_type` -> BlockInts."""
    if ggml_type not in LAYOUTS:
        raise ValueError(f"tensor {name}: type {ggml_type.name} has no integer form")
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    check_shape(ggml_type, raw.size, shape, name)
    n, k = shape
    blocks = raw.reshape(-1, BLOCK_BYTES[ggml_type])
    none = None
    if ggml_type == T.MXFP4:
        values = MXFP4_VALUES[_nibbles_32(blocks[:, 1:])]
        scales = np.ldexp(np.float32(1), blocks[:, 0].astype(np.int32) - 128).astype(np.float32)
        return BlockInts(ggml_type, values.reshape(n, k), scales.reshape(n, k // BLOCK), none, none, none)
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        has_minimum = ggml_type in (T.Q4_1, T.Q5_1)
        scales = _halves(blocks[:, 0:2])
        minimums = -_halves(blocks[:, 2:4]) if has_minimum else none
        body = blocks[:, 4:] if has_minimum else blocks[:, 2:]
        if ggml_type == T.Q8_0:
            values = (body.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        elif ggml_type in (T.Q5_0, T.Q5_1):
            values = _nibbles_32(body[:, 4:]) | (_bits(body[:, :4], 32) << 4)
        else:
            values = _nibbles_32(body)
        per_row = k // BLOCK
        return BlockInts(ggml_type, values.reshape(n, k), scales.reshape(n, per_row),
                         None if minimums is None else minimums.reshape(n, per_row), none, none)
    num_super = blocks.shape[0]
    per_row = k // SUPER_BLOCK
    if ggml_type == T.Q6_K:
        ql, qh, sub_scales = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208].view(np.int8)
        scales = _halves(blocks[:, 208:210])
        # per 128-weight half h: ql[64h + l] low nibble -> weight 128h + l, high -> 128h + 64 + l;
        # qh[32h + l] bits 2c..2c+1 -> weight 128h + 32c + l
        low = np.concatenate([ql.reshape(num_super, 2, 64) & 15, ql.reshape(num_super, 2, 64) >> 4], axis=-1)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = ((qh.reshape(num_super, 2, 1, 32) >> shifts) & 3).reshape(num_super, 2, 128)
        values = (low | (high << 4)).reshape(n, k)
        return BlockInts(ggml_type, values, scales.reshape(n, per_row), none,
                         np.ascontiguousarray(sub_scales).reshape(n, k // 16), none)
    scales, minimums = _halves(blocks[:, 0:2]), _halves(blocks[:, 2:4])
    sub_scales, sub_minimums = _k_scales(blocks[:, 4:16])
    qs = blocks[:, -128:].reshape(num_super, 4, 32)
    # chunk c of 32 bytes: low nibbles -> weights 64c + l, high nibbles -> 64c + 32 + l
    values = np.stack([qs & 15, qs >> 4], axis=2).reshape(num_super, 256)
    if ggml_type == T.Q5_K:
        qh = blocks[:, 16:48]
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        values = values | ((((qh[:, None, :] >> shifts) & 1).reshape(num_super, 256)) << 4)
    return BlockInts(ggml_type, values.reshape(n, k), scales.reshape(n, per_row), minimums.reshape(n, per_row),
                     sub_scales.reshape(n, k // BLOCK), sub_minimums.reshape(n, k // BLOCK))


def _as_half_bytes(values: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(values.astype(np.float16)).view(np.uint8).reshape(*values.shape, 2)


def _nibble_bytes_32(u: np.ndarray) -> np.ndarray:
    return (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)


def pack(ints: BlockInts) -> np.ndarray:
    """BlockInts -> the GGUF bytes of the tensor (flat uint8), the inverse of unpack."""
    ggml_type = ints.ggml_type
    n, k = ints.values.shape
    u = ints.values.astype(np.uint8)
    if ggml_type == T.MXFP4:
        codes = MXFP4_CODES[u.reshape(-1, BLOCK)]
        if (codes == 255).any():
            raise ValueError("MXFP4 values must be E2M1 codes' (MXFP4_VALUES)")
        _, exponents = np.frexp(ints.scales.astype(np.float32).reshape(-1, 1))  # 2^(e - 128) = 0.5 * 2^(e - 127)
        return np.concatenate([(exponents + 127).astype(np.uint8), _nibble_bytes_32(codes)], axis=-1).reshape(-1)
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        u = u.reshape(-1, BLOCK)
        parts = [_as_half_bytes(ints.scales.reshape(-1))]
        if ints.minimums is not None:
            parts.append(_as_half_bytes(-ints.minimums.reshape(-1)))
        if ggml_type == T.Q8_0:
            parts.append((u.astype(np.int16) - 128).astype(np.int8).view(np.uint8))
        else:
            if ggml_type in (T.Q5_0, T.Q5_1):
                parts.append(np.packbits((u >> 4) & 1, axis=-1, bitorder="little"))
            parts.append(_nibble_bytes_32(u))
        return np.concatenate(parts, axis=-1).reshape(-1)
    num_super = n * k // SUPER_BLOCK
    u = u.reshape(num_super, SUPER_BLOCK)
    if ggml_type == T.Q6_K:
        halves = u.reshape(num_super, 2, 128)
        low, high = halves & 15, halves >> 4
        ql = (low[..., :64] | (low[..., 64:] << 4)).reshape(num_super, 128)
        crumbs = high.reshape(num_super, 2, 4, 32)
        qh = (crumbs[:, :, 0] | (crumbs[:, :, 1] << 2) | (crumbs[:, :, 2] << 4) | (crumbs[:, :, 3] << 6))
        sub_scales = ints.sub_scales.astype(np.int8).reshape(num_super, 16).view(np.uint8)
        return np.concatenate([ql, qh.reshape(num_super, 64), sub_scales,
                               _as_half_bytes(ints.scales.reshape(-1))], axis=-1).reshape(-1)
    chunks = u.reshape(num_super, 4, 2, 32)
    qs = ((chunks[:, :, 0] & 15) | ((chunks[:, :, 1] & 15) << 4)).reshape(num_super, 128)
    parts = [_as_half_bytes(ints.scales.reshape(-1)), _as_half_bytes(ints.minimums.reshape(-1)),
             _pack_k_scales(ints.sub_scales.reshape(num_super, 8).astype(np.uint8),
                            ints.sub_minimums.reshape(num_super, 8).astype(np.uint8))]
    if ggml_type == T.Q5_K:
        bits = ((u.reshape(num_super, 8, 32) >> 4) & 1)
        parts.append(sum(bits[:, i] << i for i in range(8)).astype(np.uint8))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(-1)
