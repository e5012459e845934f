"""The C++ CPU kernels against the plain PyTorch path (model/kernels, model/ops)."""

import pytest
import torch
import torch.nn.functional as F

from gguf import GGMLQuantizationType

from tokios.model.kernels import (BLOCK, Q4_1, Q8_0, QuantizedLinear, dequantize_blocks, dequantize_packed,
                                  load_extension, quantize_q4_1, quantize_q8_0)
from tokios.model.quant import PackedWeight

extension = load_extension()
needs_extension = pytest.mark.skipif(extension is None, reason="C++ kernel could not be built on this machine")


def reference_quant_linear(x: torch.Tensor, blocks: torch.Tensor, block_format: int, in_features: int,
                           precise: bool = False) -> torch.Tensor:
    """What the kernel computes: activations rounded to 8-bit blocks of 32 (precise: plus a second
    8-bit plane for the residual, at 1/128 of a step), then exact sums."""
    rows = x.double().reshape(x.shape[0], -1, BLOCK)
    scale = rows.abs().amax(-1, keepdim=True).float().double() / 127.0
    scaled = torch.where(scale > 0, rows / scale, torch.zeros_like(rows))
    quantized = torch.round(scaled)
    if precise:
        quantized = quantized + torch.round((scaled - quantized) * 128) / 128
    activations = (quantized * scale).reshape(x.shape)
    return activations @ dequantize_blocks(blocks, block_format, in_features).double().T


@pytest.mark.parametrize("block_format", [Q4_1, Q8_0])
def test_quantizers_round_trip_within_one_step(block_format):
    torch.manual_seed(0)
    weight = torch.randn(64, 96)
    quantize = quantize_q4_1 if block_format == Q4_1 else quantize_q8_0
    restored = dequantize_blocks(quantize(weight), block_format, 96)
    blocks = weight.reshape(64, -1, BLOCK)
    if block_format == Q4_1:
        step = (blocks.amax(-1) - blocks.amin(-1)) / 15
    else:
        step = blocks.abs().amax(-1) / 127
    error = (restored - weight).abs().reshape(64, -1, BLOCK).amax(-1)
    # Half a step of rounding, plus the fp16 rounding of the stored scale (up to 127 steps x 2^-11).
    assert torch.all(error <= step * 0.57 + 1e-3)


def test_q4_1_requantization_of_q4_1_values_is_exact():
    torch.manual_seed(1)
    weight = dequantize_blocks(quantize_q4_1(torch.randn(32, 64)), Q4_1, 64)
    assert torch.equal(dequantize_blocks(quantize_q4_1(weight), Q4_1, 64), weight)


@needs_extension
@pytest.mark.parametrize("block_format", [Q4_1, Q8_0])
@pytest.mark.parametrize("num_rows", [1, 3, 17, 130])
@pytest.mark.parametrize("in_features", [256, 96])
@pytest.mark.parametrize("precise", [False, True])
def test_quant_linear_matches_reference(block_format, num_rows, in_features, precise):
    torch.manual_seed(num_rows)
    weight = torch.randn(200, in_features)  # 200 features: the last group of 16 is partial
    linear = QuantizedLinear(weight, torch.randn(200), block_format, precise_activations=precise)
    x = torch.randn(num_rows, in_features)
    blocks = (quantize_q4_1 if block_format == Q4_1 else quantize_q8_0)(weight)
    expected = reference_quant_linear(x, blocks, block_format, in_features, precise) + linear.bias.double()
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 200)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)


@needs_extension
@pytest.mark.parametrize("block_format", [Q4_1, Q8_0])
@pytest.mark.parametrize("precise", [False, True])
def test_rows_do_not_depend_on_the_batch(block_format, precise):
    torch.manual_seed(3)
    linear = QuantizedLinear(torch.randn(128, 192), None, block_format, precise_activations=precise)
    rows = torch.randn(70, 192)  # 70: tiles of 8 and a chunk boundary at 64
    alone = torch.cat([linear(rows[i:i + 1]) for i in range(70)])
    assert torch.equal(linear(rows), alone)


@needs_extension
def test_precise_activations_are_closer_to_float():
    torch.manual_seed(8)
    weight, x = torch.randn(64, 256), torch.randn(12, 256)
    exact = x.double() @ dequantize_blocks(quantize_q4_1(weight), Q4_1, 256).double().T
    errors = [(QuantizedLinear(weight, None, Q4_1, precise_activations=p)(x).double() - exact).norm() / exact.norm()
              for p in (False, True)]
    assert errors[1] < errors[0] / 50


@needs_extension
@pytest.mark.parametrize("precise", [False, True])
def test_q8_0_extreme_weights_are_exact(precise):
    """Q8_0 is packed as q + 128 (unsigned, as vpdpbusd wants) and 128 * sum(x) is subtracted
    again; at the extreme bytes (-128, -127, 127) and full-scale activations of both signs, where
    the precise mode's sums are largest, that must still be exact."""
    weight = torch.full((16, 64), 1.0)
    weight[::2] = -1.0
    blocks = quantize_q8_0(weight)
    blocks.view(16, 2, 34)[3, :, 2:] = 0x80  # q = -128, which the quantizer never writes
    linear = QuantizedLinear(PackedWeight(blocks, GGMLQuantizationType.Q8_0, (16, 64)), None, Q8_0,
                             precise_activations=precise)
    x = torch.ones(3, 64)
    x[1] = -1.0
    x[2, ::2] = -1.0
    expected = reference_quant_linear(x, blocks, Q8_0, 64, precise)  # fp16 scales: 1/127 is not exact
    torch.testing.assert_close(linear(x).double(), expected, rtol=1e-6, atol=0)


@needs_extension
def test_dequantize_packed_inverts_the_packing():
    torch.manual_seed(10)
    for block_format, quantize in ((Q4_1, quantize_q4_1), (Q8_0, quantize_q8_0)):
        blocks = quantize(torch.randn(200, 96))
        packed = extension.pack_weight(blocks, block_format, 96)
        assert torch.equal(dequantize_packed(packed, block_format, 200, 96),
                           dequantize_blocks(blocks, block_format, 96))


@needs_extension
def test_packed_weight_is_checked():
    linear = QuantizedLinear(torch.randn(40, 64), None, Q4_1)
    with pytest.raises(RuntimeError, match="packed by pack_weight"):
        extension.quant_linear(torch.randn(2, 64), linear.packed, Q4_1, 200, False, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        extension.quant_linear(torch.randn(2, 64), linear.packed, Q4_1, 40, False, torch.randn(3))


@needs_extension
def test_elementwise_ops_match_torch():
    torch.manual_seed(6)
    x, weight = torch.randn(5, 64), torch.randn(64)
    torch.testing.assert_close(extension.rms_norm(x, weight, 1e-5), F.rms_norm(x, (64,), weight, 1e-5))
    gate_up = torch.randn(5, 2 * 48)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(extension.silu_mul(gate_up), F.silu(gate) * up)


@needs_extension
@pytest.mark.parametrize("head_dim", [16, 24])  # 16: the AVX-512 path; 24: the portable loops
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
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
    caches = [(torch.randn(num_slots, 2, head_dim).to(cache_dtype), torch.randn(num_slots, 2, head_dim).to(cache_dtype))
              for _ in range(2)]
    caches[1] = (caches[0][0].clone(), caches[0][1].clone())
    qkv = torch.randn(2, qkv_size)
    positions = context_lens - 1
    metadata = AttentionMetadata(slot_mapping=torch.tensor([21, 44]), num_decode_tokens=2,
                                 decode_slot_indices=slot_table,
                                 decode_context_lens=context_lens)
    expected = torch_ops.attention(qkv.clone(), positions, *caches[0], metadata, torch_ops.rope_tables(positions))
    actual = kernel_ops.attention(qkv.clone(), positions, *caches[1], metadata, None)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # Rotated keys may differ in the last float32 bit, which can flip a bfloat16 rounding.
    key_tolerance = 1e-6 if cache_dtype == torch.float32 else 2 ** -8
    torch.testing.assert_close(caches[1][0], caches[0][0], rtol=key_tolerance, atol=key_tolerance)
    torch.testing.assert_close(caches[1][1], caches[0][1], rtol=0, atol=0)  # values are copied, not computed


@needs_extension
@pytest.mark.skipif(not extension.has_vnni() if extension else True, reason="the VNNI path is the reference here")
def test_portable_scalar_path_matches_the_vnni_path():
    """Machines without AVX-512 VNNI compile the scalar loops; build them here (x86-64-v2, cached
    like the main build) and check the same packed weights give the same products."""
    from tokios.model.kernels import compile_kernels

    try:
        portable = compile_kernels("tokios_cpu_kernels_portable", march="x86-64-v2")
    except Exception as exc:  # an older compiler without -march=x86-64-v2
        pytest.skip(f"could not build the portable kernels here: {str(exc).splitlines()[0]}")
    assert not portable.has_vnni()
    torch.manual_seed(9)
    for block_format, quantize in ((Q4_1, quantize_q4_1), (Q8_0, quantize_q8_0)):
        weight, bias, x = torch.randn(200, 96), torch.randn(200), torch.randn(11, 96)
        packed = extension.pack_weight(quantize(weight), block_format, 96)
        assert torch.equal(portable.pack_weight(quantize(weight), block_format, 96), packed)
        for precise in (False, True):
            torch.testing.assert_close(portable.quant_linear(x, packed, block_format, 200, precise, bias),
                                       extension.quant_linear(x, packed, block_format, 200, precise, bias),
                                       rtol=1e-5, atol=1e-4)
    # Without VNNI, many rows take a dequantized bfloat16 product instead of the scalar loops.
    linear = QuantizedLinear(torch.randn(64, 96), None, Q4_1)
    x = torch.randn(QuantizedLinear.SCALAR_PATH_MAX_ROWS + 5, 96)
    on_vnni = linear(x)
    linear.extension = portable
    relative = ((linear(x) - on_vnni).norm() / on_vnni.norm()).item()
    assert relative < 1e-2  # bfloat16 against 8-bit activations
    gate_up, weight = torch.randn(5, 96), torch.randn(96)
    torch.testing.assert_close(portable.silu_mul(gate_up), extension.silu_mul(gate_up))
    torch.testing.assert_close(portable.rms_norm(gate_up, weight, 1e-5), extension.rms_norm(gate_up, weight, 1e-5))
