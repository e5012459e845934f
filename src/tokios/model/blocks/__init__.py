"""GGML block formats: their integer form (codec), our own quantizers (quantize) and a writer
of GGUF files requantized into any mix of them (requantize). The kernels (model/kernels) pack
the integer form; the loader (model/loader.py) keeps a file's blocks as they are stored."""

from tokios.model.blocks.codec import BLOCK_BYTES, LAYOUTS, BlockInts, check_shape, pack, unpack
from tokios.model.blocks.quantize import quantize, quantize_ints

KERNEL_TYPES = frozenset(LAYOUTS)

__all__ = ["BLOCK_BYTES", "KERNEL_TYPES", "LAYOUTS", "BlockInts", "check_shape", "pack", "quantize",
           "quantize_ints", "unpack"]
