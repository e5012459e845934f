"""MXFP4 (model/blocks/mxfp4.py) byte for byte against llama.cpp's own C: its ggml-quants.c from
the pinned sources (model_files.llama_cpp_sources()), compiled here into a small library with
four stubs for the ggml functions the file calls but these two functions never reach, and
called through ctypes: quantize_row_mxfp4_ref (what llama-quantize's MXFP4_MOE writes) and
dequantize_row_mxfp4 (what llama.cpp computes from the bytes). Random rows of many magnitudes,
and blocks built on the edges of the choice: all zero, weights exactly halfway between two
codes, block maxima at and just below powers of two."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from tokios.model.blocks import quantize
from tokios.model.blocks.mxfp4 import BLOCK, BLOCK_BYTES, E2M1_DOUBLED, half_scales, quantize_mxfp4
from tokios.model.quant import dequantize
from tokios.model_files import llama_cpp_sources

_STUBS = """
#include "ggml-quants.c"
void ggml_abort(const char * file, int line, const char * fmt, ...) { abort(); }
size_t ggml_row_size(enum ggml_type type, int64_t ne) { abort(); }
const char * ggml_type_name(enum ggml_type type) { abort(); }
size_t ggml_type_size(enum ggml_type type) { abort(); }
"""


@pytest.fixture(scope="module")
def llama_cpp_quants(tmp_path_factory):
    """llama.cpp's ggml-quants.c as a ctypes library (about 2 s to compile)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build llama.cpp's reference quantizer")
    ggml = llama_cpp_sources() / "ggml"
    directory = tmp_path_factory.mktemp("ggml-quants")
    (directory / "reference.c").write_text(_STUBS)
    library = directory / "reference.so"
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", f"-I{ggml / 'include'}", f"-I{ggml / 'src'}",
                    str(directory / "reference.c"), "-o", str(library), "-lm"], check=True, capture_output=True)
    return ctypes.CDLL(str(library))


def _call_row_function(function, source: np.ndarray, out: np.ndarray, num_weights: int) -> np.ndarray:
    """ggml's (const void * x, void * y, int64_t k) row functions over numpy arrays."""
    function(source.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(num_weights))
    return out


def reference_quantize(library, rows: np.ndarray) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    return _call_row_function(library.quantize_row_mxfp4_ref, rows,
                              np.zeros(rows.size // BLOCK * BLOCK_BYTES, dtype=np.uint8), rows.size)


def reference_dequantize(library, raw: np.ndarray) -> np.ndarray:
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    out = np.zeros(raw.size // BLOCK_BYTES * BLOCK, dtype=np.float32)
    return _call_row_function(library.dequantize_row_mxfp4, raw, out, out.size)


def edge_blocks(rng: np.random.Generator) -> np.ndarray:
    """Blocks on the edges of the exponent choice and of the nearest-code rule."""
    blocks = [np.zeros(BLOCK, dtype=np.float32)]
    for power in (-20, -3, 0, 1, 5, 30):
        for top in (np.float32(2.0 ** power), np.nextafter(np.float32(2.0 ** power), np.float32(0))):
            block = rng.uniform(-1, 1, BLOCK).astype(np.float32) * top
            block[rng.integers(BLOCK)] = top * rng.choice([-1, 1])
            blocks.append(block)
    # Every weight halfway between two neighbouring codes (and on the codes): ties go to the first.
    scale = np.float32(2.0 ** -3)  # the half-scale of a block whose largest weight is in [1, 2)
    values = np.sort(np.unique(E2M1_DOUBLED)) * scale
    midpoints = np.concatenate([(values[1:] + values[:-1]) / 2, values])
    for start in range(0, len(midpoints), BLOCK - 1):
        block = np.resize(midpoints[start:start + BLOCK - 1], BLOCK - 1)
        blocks.append(np.append(block, np.float32(1.5)).astype(np.float32))
    return np.stack(blocks)


@pytest.mark.parametrize("magnitude", [1e-6, 0.02, 1.0, 300.0, 1e12])
def test_quantizer_writes_llama_cpp_bytes_on_random_rows(llama_cpp_quants, magnitude):
    rng = np.random.default_rng(int(np.log10(magnitude) + 10))
    rows = (rng.standard_normal((64, 256)) * magnitude).astype(np.float32)
    rows[3, :BLOCK] = rng.laplace(size=BLOCK) * magnitude  # a heavy-tailed block
    np.testing.assert_array_equal(quantize_mxfp4(rows), reference_quantize(llama_cpp_quants, rows))


def test_quantizer_writes_llama_cpp_bytes_on_edge_blocks(llama_cpp_quants):
    blocks = edge_blocks(np.random.default_rng(7))
    ours = quantize_mxfp4(blocks)
    np.testing.assert_array_equal(ours, reference_quantize(llama_cpp_quants, blocks))
    assert ours[0] == 0 and not ours[1:BLOCK_BYTES].any(), "an all-zero block is exponent 0, codes 0"


def test_dequantized_bytes_equal_llama_cpp_and_are_near_the_weights(llama_cpp_quants):
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((16, 128)).astype(np.float32)
    raw = quantize(rows, T.MXFP4)
    ours = dequantize(raw, T.MXFP4, rows.shape).numpy()
    np.testing.assert_array_equal(ours.reshape(-1), reference_dequantize(llama_cpp_quants, raw))
    # A code is at most half a step from its weight: the widest step of E2M1 is 2 (4 to 6) in
    # units of the block's scale 2^(e - 127), so at most 1 such unit, a quarter of the block's maximum.
    absmax = np.abs(rows.reshape(-1, BLOCK)).max(axis=1, keepdims=True)
    assert (np.abs(ours - rows).reshape(-1, BLOCK) <= absmax / 4 + 1e-7).all()


def test_half_scales_are_e8m0_halved():
    exponents = np.array([0, 1, 2, 127, 128, 254], dtype=np.uint8)
    expected = np.array([2.0 ** -128, 2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0 ** 126], dtype=np.float32)
    np.testing.assert_array_equal(half_scales(exponents), expected)


def test_rows_not_whole_blocks_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(np.zeros((2, 48), dtype=np.float32))
