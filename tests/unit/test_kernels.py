"""The C++ CPU kernels against the plain PyTorch path (model/kernels, model/ops)."""

import pytest
import torch
import torch.nn.functional as F

from tokios.model.kernels import (BLOCK, Q4_1, Q8_0, QuantizedLinear, dequantize_blocks, load_extension,
                                  quantize_q4_1, quantize_q8_0)

extension = load_extension()
needs_extension = pytest.mark.skipif(extension is None, reason="C++ kernel could not be built on this machine")


def reference_quant_linear(x: torch.Tensor, blocks: torch.Tensor, block_format: int, in_features: int) -> torch.Tensor:
    """What the kernel computes: activations rounded to 8-bit blocks of 32, then exact sums."""
    rows = x.double().reshape(x.shape[0], -1, BLOCK)
    scale = rows.abs().amax(-1, keepdim=True).float().double() / 127.0
    quantized = torch.round(torch.where(scale > 0, rows / scale, torch.zeros_like(rows)))
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
@pytest.mark.parametrize("in_features", [256, 96])  # 96: an odd number of blocks (the kernel pairs them)
def test_quant_linear_matches_reference(block_format, num_rows, in_features):
    torch.manual_seed(num_rows)
    linear = QuantizedLinear(torch.randn(200, in_features), torch.randn(200), block_format)
    x = torch.randn(num_rows, in_features)
    expected = reference_quant_linear(x, linear.blocks, block_format, in_features) + linear.bias.double()
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (num_rows, 200)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-3)


@needs_extension
def test_decode_rows_do_not_depend_on_the_batch():
    torch.manual_seed(3)
    linear = QuantizedLinear(torch.randn(128, 192), None, Q4_1)
    rows = torch.randn(9, 192)
    alone = torch.cat([linear(rows[i:i + 1]) for i in range(9)])
    assert torch.equal(linear(rows), alone)


@needs_extension
def test_prefill_rows_take_the_bf16_path_close_to_dense():
    torch.manual_seed(4)
    linear = QuantizedLinear(torch.randn(96, 128), None, Q8_0)
    x = torch.randn(40, 128)
    dense = x @ dequantize_blocks(linear.blocks, Q8_0, 128).T
    mixed = linear(x, num_decode_rows=4)
    torch.testing.assert_close(mixed[:4], linear(x[:4]))  # decode rows: the 8-bit kernel
    # bf16 product: relative error of bf16 rounding (2^-8), not of 8-bit activations.
    assert ((mixed[4:] - dense[4:]).norm() / dense[4:].norm()).item() < 5e-3


@needs_extension
def test_dequantize_bf16_matches_torch():
    torch.manual_seed(5)
    for block_format, quantize in ((Q4_1, quantize_q4_1), (Q8_0, quantize_q8_0)):
        blocks = quantize(torch.randn(48, 96))
        expected = dequantize_blocks(blocks, block_format, 96).to(torch.bfloat16)
        assert torch.equal(extension.dequantize_bf16(blocks, block_format, 96), expected)


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
