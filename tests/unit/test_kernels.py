"""The C++ CPU kernels against plain PyTorch (model/kernels, model/ops), for every block type
the kernels run: each product against its dequantized weights times the activations the kernel
quantized, at many row counts, odd output sizes, extreme block values and in a batch."""

import functools
import itertools
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from tokios.model.attention import dequantize_kv, quantize_kv
from tokios.model.blocks import BLOCK_BYTES, KERNEL_TYPES, LAYOUTS, quantize, quantize_ints, unpack
from tokios.model.blocks.codec import pack
from tokios.model.kernels import (BLOCK, FORMAT_BY_TYPE, QuantizedLinear, has_vector_kernels, load_extension,
                                  quantize_q4_1, quantize_q8_0)
from tokios.model.quant import PackedWeight

extension = load_extension()
needs_extension = pytest.mark.skipif(extension is None, reason="C++ kernel could not be built on this machine")
ALL_TYPES = sorted(KERNEL_TYPES, key=lambda t: t.value)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def packed_weight(weight: np.ndarray, ggml_type: T) -> PackedWeight:
    n, k = weight.shape
    return PackedWeight(torch.from_numpy(quantize(weight, ggml_type)).reshape(n, -1), ggml_type, (n, k), "test")


def dequantized(weight: PackedWeight) -> torch.Tensor:
    return torch.from_numpy(unpack(weight.raw.numpy(), weight.ggml_type, weight.shape).dequantize())


def kernel_activations(x: torch.Tensor, precise: bool = False) -> torch.Tensor:
    """The activations the kernel multiplies by: 8-bit blocks of 32 rounded exactly as it rounds
    (float32 scale, inverse and product, then to nearest even); precise adds the residual plane."""
    rows = x.float().reshape(x.shape[0], -1, BLOCK)
    scale = rows.abs().amax(-1, keepdim=True) / 127.0
    inverse = torch.where(scale >= torch.finfo(torch.float32).tiny, 1.0 / scale, torch.zeros_like(scale))
    scaled = rows * inverse
    quantized = torch.round(scaled).double()
    if precise:
        quantized = quantized + torch.round((scaled - torch.round(scaled)) * 128).double() / 128
    return (quantized * scale.double()).reshape(x.shape)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, precise: bool = False):
    out = kernel_activations(x, precise) @ weight.double().T
    return out if bias is None else out + bias.double()


def random_weight(n: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_integer_form_round_trips_every_byte_and_dequantizes_as_gguf(ggml_type):
    from gguf import quants as gguf_quants

    n, k = 3, 512
    num_blocks = n * k // (256 if ggml_type in K_QUANTS else 32)
    raw = np.random.default_rng(1).integers(0, 256, num_blocks * BLOCK_BYTES[ggml_type], dtype=np.uint8)
    if ggml_type == T.MXFP4:  # code 8 is -0, the same weight as code 0 (+0), which packing writes
        codes = raw.reshape(-1, BLOCK_BYTES[ggml_type])[:, 1:]
        codes &= np.where(codes & 0x0F == 8, 0xF0, 0xFF).astype(np.uint8)
        codes &= np.where(codes & 0xF0 == 0x80, 0x0F, 0xFF).astype(np.uint8)
    ints = unpack(raw, ggml_type, (n, k))
    assert np.array_equal(pack(ints), raw)
    with np.errstate(all="ignore"):  # random fp16 scales include inf and nan
        ours, theirs = ints.dequantize(), gguf_quants.dequantize(raw.reshape(n, -1), ggml_type).reshape(n, k)
    finite = np.isfinite(theirs)
    assert finite.mean() > 0.5 and np.array_equal(ours[finite], theirs[finite])


# Worst error of our quantizers per type, relative to the row's largest magnitude: a step of
# the symmetric types (max / 8, / 16, / 32: the side opposite the extreme is clipped one step
# short), half a step of the others (a step spans max - min, up to twice the extreme), plus the rounding of their stored scales.
QUANTIZER_BOUNDS = {T.Q4_0: 0.13, T.Q4_1: 0.07, T.Q5_0: 0.07, T.Q5_1: 0.035, T.Q8_0: 0.005,
                    T.Q4_K: 0.08, T.Q5_K: 0.045, T.Q6_K: 0.035,
                    # llama.cpp's MXFP4 exponent puts the largest weight at 4 to 8 scale units and
                    # clips it to 6: up to a quarter of it; E2M1's widest gap (4 to 6) halves to 1/8.
                    T.MXFP4: 0.26}


@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_quantizers_write_valid_blocks_close_to_the_weights(ggml_type):
    weight = random_weight(8, 512, 2)
    raw = quantize(weight, ggml_type)
    restored = unpack(raw, ggml_type, weight.shape).dequantize()
    error = np.abs(restored - weight).max(axis=1) / np.abs(weight).max(axis=1)
    assert error.max() < QUANTIZER_BOUNDS[ggml_type]


@pytest.mark.parametrize("ggml_type", K_QUANTS, ids=lambda t: t.name)
def test_k_quant_rows_must_be_whole_super_blocks(ggml_type):
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_ints(random_weight(2, 96, 0), ggml_type)


def test_q4_1_requantization_of_q4_1_values_is_exact():
    weight = dequantized(PackedWeight(quantize_q4_1(torch.randn(32, 64)), T.Q4_1, (32, 64)))
    again = dequantized(PackedWeight(quantize_q4_1(weight), T.Q4_1, (32, 64)))
    assert torch.equal(again, weight)


@pytest.mark.parametrize("conversion, ggml_type", [(quantize_q4_1, T.Q4_1), (quantize_q8_0, T.Q8_0)])
def test_conversion_quantizers_round_trip_within_one_step(conversion, ggml_type):
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    restored = dequantized(PackedWeight(conversion(weight), ggml_type, (64, 96)))
    blocks = weight.reshape(64, -1, BLOCK)
    step = (blocks.amax(-1) - blocks.amin(-1)) / 15 if ggml_type == T.Q4_1 else blocks.abs().amax(-1) / 127
    error = (restored - weight).abs().reshape(64, -1, BLOCK).amax(-1)
    # Half a step of rounding, plus the fp16 rounding of the stored scale (up to 127 steps x 2^-11).
    assert torch.all(error <= step * 0.57 + 1e-3)


@needs_extension
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("in_features", [512, 96])
def test_every_block_type_matches_its_dequantized_product(ggml_type, in_features):
    if in_features % 256 and ggml_type in K_QUANTS:
        pytest.skip("K-quant rows are whole 256-weight super-blocks")
    weight = packed_weight(random_weight(203, in_features, 3), ggml_type)  # 203: a partial last group
    bias = torch.randn(203)
    linear = QuantizedLinear(weight, bias)
    dense = dequantized(weight)
    assert torch.equal(linear.dequantized_weight(), dense)
    torch.manual_seed(4)
    for num_rows in (1, 2, 3, 8, 16, 64, 300):
        x = torch.randn(num_rows, in_features)
        out = linear(x)
        assert out.dtype == torch.float32 and out.shape == (num_rows, 203)
        torch.testing.assert_close(out.double(), reference(x, dense, bias), rtol=1e-5, atol=2e-4)


@needs_extension
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_batch(ggml_type):
    linear = QuantizedLinear(packed_weight(random_weight(128, 256, 5), ggml_type), None)
    rows = torch.randn(70, 256)  # 70: several tiles and a chunk boundary at 64
    alone = torch.cat([linear(rows[i:i + 1]) for i in range(70)])
    assert torch.equal(linear(rows), alone)


def input_feature_shard(weight: PackedWeight, start: int, stop: int) -> PackedWeight:
    """Input features [start, stop) of a packed weight, cut on block boundaries as tensor
    parallel cuts o_proj and down (distributed/plan.py)."""
    block, block_bytes = GGML_QUANT_SIZES[weight.ggml_type]
    raw = weight.raw[:, start // block * block_bytes:stop // block * block_bytes].contiguous()
    return PackedWeight(raw, weight.ggml_type, (weight.shape[0], stop - start), "shard")


@needs_extension
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
def test_row_parallel_shards_add_up_to_the_whole_product_bit_for_bit(ggml_type):
    """A row-parallel shard's float64 sums (partial_sums, exact_sums), added over the shards in
    any order and rounded to float32 once, are the whole weight's product bit for bit, for even
    and uneven splits, on tiles of rows and with outputs of every size: the kernel's sum over
    blocks is exact. One last-bit difference moves the next layer's 8-bit activation rounding,
    which changed the default model's greedy text at tensor parallel 3. Without exact_sums the
    product is the float32 one and has no partial sums of its own."""
    block = 256 if ggml_type in K_QUANTS else BLOCK
    in_features = 6 * block
    weight = packed_weight(random_weight(83, in_features, 12), ggml_type)  # 83: a partial last group
    torch.manual_seed(13)
    x = torch.randn(70, in_features) * torch.logspace(-4, 2, 70)[:, None]  # outputs from ~1e-3 to ~1e4
    splits = [(0, 2 * block, 4 * block, 6 * block), (0, block, 6 * block), (0, 5 * block, 6 * block)]
    for precise in (False, True) if ggml_type in (T.Q4_1, T.Q8_0) else (False,):
        whole = QuantizedLinear(weight, None, precise_activations=precise, exact_sums=True)
        expected_sums = whole.partial_sums(x)
        assert expected_sums.dtype == torch.float64
        assert torch.equal(expected_sums.float(), whole(x))
        for bounds in splits:
            shards = [(start, QuantizedLinear(input_feature_shard(weight, start, stop), None,
                                              precise_activations=precise, exact_sums=True), stop)
                      for start, stop in zip(bounds, bounds[1:])]
            for rows in (slice(0, 1), slice(0, 3), slice(0, 70)):
                sums = [shard.partial_sums(x[rows, start:stop]) for start, shard, stop in shards]
                for order in itertools.permutations(sums):
                    total = functools.reduce(torch.add, order)
                    assert torch.equal(total, expected_sums[rows]), (bounds, rows, precise)
                    assert torch.equal(total.float(), whole(x[rows])), (bounds, rows, precise)
        plain = QuantizedLinear(weight, None, precise_activations=precise)
        exact = whole(x)  # float32 sums differ from it by their rounding, relative to each row's size
        assert ((plain(x) - exact).abs() <= 1e-5 * exact.abs().amax(dim=1, keepdim=True)).all()
        with pytest.raises(RuntimeError, match="exact_sums"):
            plain.linear.partial_sums(x)


def extreme_ints(ggml_type: T, k: int, largest: bool):
    """Blocks at the ends of their ranges: every u at its maximum (largest) or 0, the fp16 scales
    at their largest finite value, the sub-scales and minimums at their largest."""
    ints = quantize_ints(random_weight(16, k, 6), ggml_type)
    bits = LAYOUTS[ggml_type][0]
    ints.values[:] = (1 << bits) - 1 if largest else 0
    ints.values[1::2] = 0 if largest else (1 << bits) - 1
    ints.scales[:] = 65504.0
    if ints.minimums is not None:
        ints.minimums[:] = 65504.0
    if ints.sub_scales is not None:
        ints.sub_scales[:] = 63 if ggml_type != T.Q6_K else -128
        ints.sub_scales[::3] = 63 if ggml_type != T.Q6_K else 127
    if ints.sub_minimums is not None:
        ints.sub_minimums[:] = 63
    return ints


@needs_extension
@pytest.mark.parametrize("ggml_type", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("largest", [True, False])
def test_extreme_block_values_are_exact(ggml_type, largest):
    k = 256
    ints = extreme_ints(ggml_type, k, largest)
    weight = PackedWeight(torch.from_numpy(pack(ints)).reshape(16, -1), ggml_type, (16, k), "extreme")
    linear = QuantizedLinear(weight, None)
    x = torch.ones(3, k)  # full-scale activations of both signs, where the integer sums are largest
    x[1] = -1.0
    x[2, ::2] = -1.0
    expected = reference(x, dequantized(weight))
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-6, atol=0)


@needs_extension
@pytest.mark.parametrize("precise", [False, True])
def test_q8_0_extreme_bytes_are_exact(precise):
    """Q8_0 at the extreme bytes (-128, which the quantizer never writes, -127, 127) against
    full-scale activations of both signs, where the precise mode's sums are largest."""
    weight = torch.full((16, 64), 1.0)
    weight[::2] = -1.0
    blocks = quantize_q8_0(weight)
    blocks.view(16, 2, 34)[3, :, 2:] = 0x80
    packed = PackedWeight(blocks, T.Q8_0, (16, 64))
    linear = QuantizedLinear(packed, None, precise_activations=precise)
    x = torch.ones(3, 64)
    x[1] = -1.0
    x[2, ::2] = -1.0
    torch.testing.assert_close(linear(x).double(), reference(x, dequantized(packed), precise=precise), rtol=1e-6, atol=0)


@needs_extension
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_precise_activations_match_their_reference_and_are_closer_to_float(ggml_type):
    torch.manual_seed(8)
    conversion = quantize_q4_1 if ggml_type == T.Q4_1 else quantize_q8_0
    weight = PackedWeight(conversion(torch.randn(200, 256)), ggml_type, (200, 256))
    dense, x, bias = dequantized(weight), torch.randn(12, 256), torch.randn(200)
    precise = QuantizedLinear(weight, bias, precise_activations=True)
    torch.testing.assert_close(precise(x).double(), reference(x, dense, bias, precise=True), rtol=1e-5, atol=2e-4)
    exact = x.double() @ dense.double().T + bias.double()
    errors = [(QuantizedLinear(weight, bias, precise_activations=p)(x).double() - exact).norm() / exact.norm()
              for p in (False, True)]
    assert errors[1] < errors[0] / 50


@needs_extension
def test_a_weight_mixing_block_types_runs_each_part_as_stored():
    from tokios.model.quant import concat_rows

    parts = [packed_weight(random_weight(48, 256, 7), T.Q5_0), packed_weight(random_weight(16, 256, 8), T.Q5_0),
             packed_weight(random_weight(32, 256, 9), T.Q6_K)]
    weight = concat_rows(parts)
    assert [part.ggml_type for part in weight.parts] == [T.Q5_0, T.Q6_K]  # runs of one type merge
    linear = QuantizedLinear(weight, torch.randn(96))
    assert linear.ggml_types == [T.Q5_0, T.Q6_K]
    dense = torch.cat([dequantized(part) for part in parts])
    x = torch.randn(9, 256)
    torch.testing.assert_close(linear(x).double(), reference(x, dense, linear.bias), rtol=1e-5, atol=2e-4)


@needs_extension
def test_packing_and_linear_inputs_are_checked():
    ints = quantize_ints(random_weight(16, 256, 0), T.Q4_K)
    as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a).view(np.int16 if a.dtype.itemsize == 2 else np.uint8))
    with pytest.raises(RuntimeError, match="sub_minimums must be given"):
        extension.pack_ints(as_tensor(ints.values), as_tensor(ints.scales), as_tensor(ints.minimums),
                            as_tensor(ints.sub_scales), None, FORMAT_BY_TYPE[T.Q4_K])
    with pytest.raises(RuntimeError, match="unknown kernel format"):
        extension.pack_ints(as_tensor(ints.values), as_tensor(ints.scales), None, None, None, 42)
    packed = extension.pack_ints(as_tensor(ints.values), as_tensor(ints.scales), as_tensor(ints.minimums),
                                 as_tensor(ints.sub_scales), as_tensor(ints.sub_minimums), FORMAT_BY_TYPE[T.Q4_K])
    with pytest.raises(RuntimeError, match="packed by pack_ints"):
        extension.PackedLinear([packed], [FORMAT_BY_TYPE[T.Q4_K]], [40], 256, False, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        extension.PackedLinear([packed], [FORMAT_BY_TYPE[T.Q4_K]], [16], 256, False, torch.randn(3))
    with pytest.raises(RuntimeError, match="precise activations"):
        extension.PackedLinear([packed], [FORMAT_BY_TYPE[T.Q4_K]], [16], 256, True, None)
    linear = extension.PackedLinear([packed], [FORMAT_BY_TYPE[T.Q4_K]], [16], 256, False, None)
    with pytest.raises(RuntimeError, match="x has 128 features"):
        linear(torch.randn(2, 128))


@needs_extension
def test_elementwise_ops_match_torch():
    torch.manual_seed(6)
    x, weight = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(extension.rms_norm(x, weight, 1e-5), F.rms_norm(x, (64,), weight, 1e-5))
    gate_up = torch.randn(5, 2 * 48)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(extension.glu_mul(gate_up, False), F.silu(gate) * up)
    torch.testing.assert_close(extension.glu_mul(gate_up, True), F.gelu(gate, approximate="tanh") * up)


def random_kv_cache(num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.randn(num_slots, num_kv_heads, head_dim)
    return quantize_kv(values) if dtype == torch.int8 else values.to(dtype)


def kv_as_float(cache: torch.Tensor) -> torch.Tensor:
    return dequantize_kv(cache, torch.float32) if cache.dtype == torch.int8 else cache.float()


KV_CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.int8]


@needs_extension
@pytest.mark.parametrize("head_dim", [16, 24, 256])  # 16: the vector path; 24: the portable loops; 256: Gemma 3
@pytest.mark.parametrize("cache_dtype", KV_CACHE_DTYPES)
def test_rope_write_and_decode_attention_match_torch_path(head_dim, cache_dtype):
    from tokios.config import ModelConfig
    from tokios.model.attention import AttentionMetadata
    from tokios.model.ops import CpuKernelOps, TorchOps
    from tokios.model.rope import RotaryEmbedding

    torch.manual_seed(7)
    config = ModelConfig("llama", num_layers=1, hidden_size=6 * head_dim, intermediate_size=64, num_heads=6,
                         num_kv_heads=2, head_dim=head_dim, vocab_size=10, max_model_len=64, rope_theta=10000.0)
    rotary = RotaryEmbedding(config, 64, torch.device("cpu"), torch.float32)
    torch_ops, kernel_ops = TorchOps(config, rotary), CpuKernelOps(config, rotary, extension)
    num_slots, qkv_size = 64, (6 + 2 * 2) * head_dim
    # Two decoding requests with 5 and 9 tokens of context in scattered slots.
    slot_table = torch.tensor([[3, 9, 4, 20, 21, 0, 0, 0, 0], [30, 31, 32, 33, 40, 41, 42, 43, 44]])
    context_lens = torch.tensor([5, 9])
    caches = [(random_kv_cache(num_slots, 2, head_dim, cache_dtype), random_kv_cache(num_slots, 2, head_dim, cache_dtype))
              for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    qkv = torch.randn(2, qkv_size)
    positions = context_lens - 1
    metadata = AttentionMetadata(slot_mapping=torch.tensor([21, 44]), num_decode_tokens=2,
                                 decode_slot_indices=slot_table,
                                 decode_context_lens=context_lens)
    expected = torch_ops.attention(qkv.clone(), positions, *caches[0], metadata, torch_ops.rope_tables(positions))
    actual = kernel_ops.attention(qkv.clone(), positions, *caches[1], metadata, None)
    # bfloat16 dot products round the queries and softmax weights to bfloat16 (8 bits): about 2^-9
    # of each; reference_attention checks that rounding exactly.
    tolerance = 1e-2 if bf16_dot_applies(extension, cache_dtype, head_dim) else 1e-5
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)
    # Rotated keys may differ in the last float32 bit, which can flip a bfloat16 or int8 rounding.
    key_tolerance = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.int8: 4 / 127}[cache_dtype]
    torch.testing.assert_close(kv_as_float(caches[1][0]), kv_as_float(caches[0][0]), rtol=key_tolerance,
                               atol=key_tolerance)
    # Values are copied, not computed: the same bytes (int8: quantized by the same arithmetic).
    assert torch.equal(caches[1][1], caches[0][1])


@functools.lru_cache(maxsize=1)
def start_older_builds() -> dict[str, Future]:
    """Start building the kernels for each older instruction set this machine's tests check
    (x86-64-v2: the portable loops; x86-64-v3 on a VNNI machine: AVX2), in the background: each
    build is one compiler process of about a minute (cached like the main build afterwards).
    tests/conftest.py starts them when the session begins and runs the tests that use them
    (marked builds_kernels) last, so the builds overlap the rest of the suite."""
    from tokios.model.kernels import compile_kernels

    if extension is None:
        return {}
    marches = [march for march, wanted in (("x86-64-v2", has_vector_kernels(extension)),
                                           ("x86-64-v3", extension.has_vnni())) if wanted]
    if not marches:
        return {}
    pool = ThreadPoolExecutor(len(marches), thread_name_prefix="kernel-build")
    futures = {march: pool.submit(compile_kernels, f"tokios_cpu_kernels_{march.replace('-', '_')}", march)
               for march in marches}
    pool.shutdown(wait=False)
    return futures


def kernels_for(march: str):
    """The kernels built for an older instruction set, or a skip. A march that would not build
    (an older compiler) is skipped with its error."""
    future = start_older_builds().get(march)
    build = None if future is None else future.exception() or future.result()
    if isinstance(build, Exception):  # an older compiler without this -march
        pytest.skip(f"could not build the {march} kernels here: {str(build).splitlines()[0]}")
    assert build is not None, f"{march} is not one of this machine's older builds"
    return build


@needs_extension
@pytest.mark.builds_kernels
@pytest.mark.skipif(extension is None or not extension.has_vnni(), reason="this build is not the VNNI one")
def test_avx2_path_gives_the_vnni_path_bits():
    """A VNNI machine runs no AVX2 kernel, so build that path (x86-64-v3) and check it here: the
    two dot kernels take the same exact integer sums and the same float steps per lane, so every
    type, alone and in tiles of rows, must come out bit for bit the same."""
    avx2 = kernels_for("x86-64-v3")
    assert avx2.has_avx2() and not avx2.has_vnni()
    for ggml_type in ALL_TYPES:
        linear = QuantizedLinear(packed_weight(random_weight(200, 512, 11), ggml_type), torch.randn(200))
        x = torch.randn(13, 512)
        fmt = FORMAT_BY_TYPE[ggml_type]
        for precise in (False, True) if ggml_type in (T.Q4_1, T.Q8_0) else (False,):
            for exact_sums in (False, True):
                vnni = extension.PackedLinear(linear._packed, [fmt], [200], 512, precise, linear.bias, exact_sums)
                older = avx2.PackedLinear(linear._packed, [fmt], [200], 512, precise, linear.bias, exact_sums)
                assert torch.equal(older(x), vnni(x)), (ggml_type.name, precise, exact_sums)
            assert torch.equal(older.partial_sums(x), vnni.partial_sums(x)), (ggml_type.name, precise)
    # Its attention loops (8 lanes, their own sum order) against the float64 reference.
    for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (4, 1, 256)):
        for cache_dtype in KV_CACHE_DTYPES:
            for prefix in (37, 1020):
                check_chunk_rows_against_each_row_alone(avx2, num_heads, num_kv_heads, head_dim, cache_dtype, prefix)


@needs_extension
@pytest.mark.builds_kernels
@pytest.mark.skipif(extension is not None and not has_vector_kernels(extension),
                    reason="this build already is the portable one")
def test_portable_scalar_path_matches_the_vector_path():
    """Machines without AVX2 compile the scalar loops; build them here (x86-64-v2, cached like
    the main build) and check the same packed weights give the same products, every type, bit
    for bit: the same integer sums and float steps per lane, and the sum over blocks is exact."""
    portable = kernels_for("x86-64-v2")
    assert not portable.has_vnni() and not portable.has_avx2()
    for ggml_type in ALL_TYPES:
        linear = QuantizedLinear(packed_weight(random_weight(200, 256, 9), ggml_type), torch.randn(200))
        x = torch.randn(11, 256)
        fmt = FORMAT_BY_TYPE[ggml_type]
        precise_options = (False, True) if ggml_type in (T.Q4_1, T.Q8_0) else (False,)
        for precise in precise_options:
            for exact_sums in (False, True):
                vector = extension.PackedLinear(linear._packed, [fmt], [200], 256, precise, linear.bias, exact_sums)
                scalar = portable.PackedLinear(linear._packed, [fmt], [200], 256, precise, linear.bias, exact_sums)
                assert torch.equal(scalar(x), vector(x)), (ggml_type.name, precise, exact_sums)
            assert torch.equal(scalar.partial_sums(x), vector.partial_sums(x)), (ggml_type.name, precise)
    # Without vector kernels, many rows take a dequantized bfloat16 product instead of the scalar loops.
    linear = QuantizedLinear(packed_weight(random_weight(64, 96, 10), T.Q4_1), None)
    x = torch.randn(QuantizedLinear.SCALAR_PATH_MAX_ROWS + 5, 96)
    on_vector = linear(x)
    linear.extension = portable
    relative = ((linear(x) - on_vector).norm() / on_vector.norm()).item()
    assert relative < 1e-2  # bfloat16 against 8-bit activations
    gate_up, weight = torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(portable.glu_mul(gate_up, False), extension.glu_mul(gate_up, False))
    torch.testing.assert_close(portable.glu_mul(gate_up, True), extension.glu_mul(gate_up, True))
    torch.testing.assert_close(portable.rms_norm(gate_up, weight, 1e-5), extension.rms_norm(gate_up, weight, 1e-5))


def reference_attention(qkv, key_cache, value_cache, slot_table, context_lens, num_heads, num_kv_heads, head_dim,
                        bf16_dot=False):
    """Each row's softmax(q K^T / sqrt(d)) V over its own first context_lens slots, in float64.
    bf16_dot: as the kernel's bfloat16 dot products take it (attend_segment_bf16): the query
    rounded to bfloat16, and each 512-key segment's weights exp(s - its maximum) rounded to
    bfloat16, summed as rounded, the segments merged by their maxima."""
    group = num_heads // num_kv_heads
    rows = []
    for row in range(qkv.shape[0]):
        slots = slot_table[row, :context_lens[row]]
        keys, values = key_cache[slots].double(), value_cache[slots].double()  # [L, kv_heads, hd]
        heads = []
        for h in range(num_heads):
            q = qkv[row, h * head_dim:(h + 1) * head_dim]
            q = (q.bfloat16() if bf16_dot else q).double()
            scores = keys[:, h // group] @ q / head_dim ** 0.5
            if not bf16_dot:
                heads.append(torch.softmax(scores, dim=0) @ values[:, h // group])
                continue
            total, weighted = 0.0, 0.0
            for start in range(0, len(scores), 512):
                segment = scores[start:start + 512]
                weights = torch.exp(segment - segment.max()).bfloat16().double()
                merge = torch.exp(segment.max() - scores.max())
                total = total + weights.sum() * merge
                weighted = weighted + weights @ values[start:start + 512, h // group] * merge
            heads.append(weighted / total)
        rows.append(torch.cat(heads))
    return torch.stack(rows).float()


def bf16_dot_applies(kernels, cache_dtype, head_dim) -> bool:
    """Whether the kernel attends over this cache with bfloat16 dot products (attend_segment_bf16)."""
    return cache_dtype == torch.bfloat16 and head_dim in (64, 128, 256) and kernels.has_bf16_dot()


@needs_extension
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(9, 3, 64),  # SmolLM2: 3 heads a KV head, 8 rows a pass
                          (32, 1, 16),  # a GQA group larger than one pass holds (24 queries)
                          (4, 1, 256),  # Gemma 3 270M
                          (6, 2, 24)])  # the portable loops
@pytest.mark.parametrize("cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("prefix", [37, 1020])  # 1020: rows cross the 512-key segments' boundary at 1,024
def test_decode_attention_over_a_prompt_chunk_equals_each_row_alone(num_heads, num_kv_heads, head_dim, cache_dtype,
                                                                   prefix):
    """The rows of a causal prompt chunk share passes over their keys (decode_attention_rows), and
    a long context is attended in segments spread over the threads; a row's result must not
    change with either (verify rows equal plain decodes bit for bit), and rows of other requests,
    even over the very same slots, are never merged into the chunk."""
    check_chunk_rows_against_each_row_alone(extension, num_heads, num_kv_heads, head_dim, cache_dtype, prefix)


def check_chunk_rows_against_each_row_alone(kernels, num_heads, num_kv_heads, head_dim, cache_dtype, prefix=37):
    torch.manual_seed(3)
    num_slots = max(256, 2 * prefix + 64)
    # Past one 512-key segment, the other request's row ends one key into its second one.
    other_len = 30 if prefix < 512 else 513
    key_cache = random_kv_cache(num_slots, num_kv_heads, head_dim, cache_dtype)
    value_cache = random_kv_cache(num_slots, num_kv_heads, head_dim, cache_dtype)
    chunk_slots = torch.randperm(num_slots)[:prefix + 20]
    other_slots = torch.randperm(num_slots)[:other_len]
    # A decode over other slots, 20 rows of one chunk (contexts prefix+1 .. prefix+20), then a
    # decode of another request that shares the chunk's slots but not its length pattern.
    lens = [other_len] + [prefix + 1 + i for i in range(20)] + [prefix + 5]
    max_len = max(lens)
    table = torch.zeros(len(lens), max_len, dtype=torch.long)
    table[0, :other_len] = other_slots
    for row in range(1, len(lens)):
        table[row, :lens[row]] = chunk_slots[:lens[row]]
    context_lens = torch.tensor(lens)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim)

    def attend(rows):
        return kernels.decode_attention(qkv[rows].contiguous(), key_cache, value_cache, table[rows].contiguous(),
                                          context_lens[rows].contiguous(), num_heads, num_kv_heads, head_dim,
                                          head_dim ** -0.5)

    together = attend(list(range(len(lens))))
    for row in range(len(lens)):
        assert torch.equal(together[row], attend([row])[0]), row
    bf16_dot = bf16_dot_applies(kernels, cache_dtype, head_dim)
    expected = reference_attention(qkv, kv_as_float(key_cache), kv_as_float(value_cache), table, lens, num_heads,
                                   num_kv_heads, head_dim, bf16_dot=bf16_dot)
    # bf16_dot: a float32 score or exp a bit off the float64 one flips the rounding of a weight
    # now and then (a 2^-8 change of that weight).
    tolerance = 1e-4 if bf16_dot else 2e-5
    torch.testing.assert_close(together, expected, rtol=tolerance, atol=tolerance)
