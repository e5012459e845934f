"""The worked figures of issue 8 and the design notes, reproduced by the plan formulas."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokios.tools.plan import formulas
from tokios.tools.plan.hardware import NAME_TO_HARDWARE
from tokios.tools.plan.model_presets import NAME_TO_PRESET
from tokios.tools.plan.capacity import PlanInputs, make_plan

KIB, GIB = 2**10, 2**30
LLAMA3_70B = NAME_TO_PRESET["llama-3-70b"]
H100 = NAME_TO_HARDWARE["h100-sxm"]


def test_llama3_70b_kv_is_320_kib_per_token_in_fp16():
    assert formulas.kv_bytes_per_token(LLAMA3_70B, 2) == 320 * KIB


def test_llama3_70b_kv_at_8k_is_about_2_6_gb():
    per_token = formulas.kv_bytes_per_token(LLAMA3_70B, 2)
    assert round(per_token * 8000 / 1e9, 1) == 2.6
    assert per_token * 8192 == pytest.approx(2.6e9, rel=0.04)


def test_without_gqa_64_kv_heads_at_8k_is_about_21_gb():
    no_gqa = dataclasses.replace(LLAMA3_70B, num_kv_heads=64)
    assert formulas.kv_bytes_per_token(no_gqa, 2) * 8192 == pytest.approx(21e9, rel=0.03)


def test_70b_fp16_weights_are_about_140_gb():
    assert formulas.weight_bytes(LLAMA3_70B, 16) == pytest.approx(140e9, rel=0.01)


def test_h100_batch1_decode_is_about_42_ms_and_24_tokens_per_s():
    plan = make_plan(PlanInputs(LLAMA3_70B, H100, weight_bits=16, context_len=8192))
    assert plan.batch1_step_bytes == pytest.approx(142e9, rel=0.01)
    assert plan.batch1_tpot_s == pytest.approx(0.042, abs=0.001)
    assert plan.batch1_tokens_per_s == pytest.approx(24, abs=1)


def test_two_80gb_gpus_less_140gb_of_weights_leave_about_65k_tokens():
    free_bytes = 2 * 80 * GIB - 140 * GIB
    assert free_bytes == 20 * GIB
    assert formulas.kv_capacity_tokens(free_bytes, 320 * KIB) == 65536


def test_16_users_at_4k_do_not_fit_on_two_h100s_with_70b_fp16():
    plan = make_plan(PlanInputs(LLAMA3_70B, H100, count=2, weight_bits=16, concurrency=16,
                                context_len=4096))
    assert not plan.fits
    assert plan.kv_bytes_total == 16 * 4096 * 320 * KIB
    assert 1 <= plan.max_concurrency < 16


def test_speculation_a08_k4_gives_3_36_tokens_per_verify_and_2_8x():
    assert formulas.expected_tokens_per_verify(0.8, 4) == pytest.approx(3.3616)
    assert round(formulas.speculative_speedup(0.8, 4, 0.05), 1) == 2.8


def test_speculation_edge_cases():
    assert formulas.expected_tokens_per_verify(0.0, 4) == 1.0
    assert formulas.expected_tokens_per_verify(1.0, 4) == 5.0


def test_ridge_at_short_context_is_the_ops_to_byte_ratio_for_16_bit_weights():
    step_weights = formulas.step_weight_bytes(LLAMA3_70B, 16)
    ridge = formulas.decode_ridge_batch_size(LLAMA3_70B, step_weights, 320 * KIB, 0,
                                             989e12, 3.35e12)
    # 2 bytes per weight and 2 FLOPs per weight: the ridge is peak / bandwidth.
    assert ridge == pytest.approx(989e12 / 3.35e12)


def test_ridge_is_infinite_when_kv_reads_outgrow_compute():
    step_weights = formulas.step_weight_bytes(LLAMA3_70B, 16)
    assert math.isinf(formulas.decode_ridge_batch_size(
        LLAMA3_70B, step_weights, 320 * KIB, 8192, 989e12, 3.35e12))


@settings(max_examples=60, deadline=None)
@given(context_len=st.integers(0, 2048), bits=st.sampled_from([4.5, 8.0, 16.0]),
       preset=st.sampled_from(sorted(NAME_TO_PRESET)))
def test_at_the_ridge_compute_time_equals_memory_time(context_len, bits, preset):
    model = NAME_TO_PRESET[preset]
    step_weights = formulas.step_weight_bytes(model, bits)
    kv_per_token = formulas.kv_bytes_per_token(model, 2)
    peak, bandwidth = 989e12, 3.35e12
    ridge = formulas.decode_ridge_batch_size(model, step_weights, kv_per_token, context_len,
                                             peak, bandwidth)
    if math.isinf(ridge):
        return
    compute_s = formulas.decode_step_flops(model, ridge, context_len) / peak
    memory_s = formulas.decode_step_bytes(step_weights, kv_per_token, ridge, context_len) / bandwidth
    assert compute_s == pytest.approx(memory_s, rel=1e-9)


def test_tensor_parallel_wider_than_kv_heads_replicates_heads():
    smollm = NAME_TO_PRESET["smollm2-135m"]  # 3 KV heads
    assert formulas.kv_bytes_per_token(smollm, 2, tp=2) == formulas.kv_bytes_per_token(smollm, 2)
    assert formulas.kv_bytes_per_token(smollm, 2, tp=4) == 2 * 30 * 4 * 64 * 2


def test_prefill_flops_count_causal_attention_and_one_logits_row():
    model = NAME_TO_PRESET["llama-3-8b"]
    prompt_len = 1000
    expected = (2 * model.num_layer_linear_params * prompt_len
                + 2 * model.num_layers * model.num_heads * model.head_dim * prompt_len**2
                + 2 * model.hidden_size * model.vocab_size)
    assert formulas.prefill_flops(model, prompt_len) == expected


def test_sliding_window_layers_hold_only_their_window():
    from tokios.model.shape import ModelShape

    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    gemma = ModelShape("gemma3-like", 18, 640, 2048, 4, 1, 256, 262144, 32768, layer_windows=windows)
    full = dataclasses.replace(gemma, layer_windows=None)
    per_token = formulas.kv_bytes_per_token(gemma, 2)
    assert formulas.kv_bytes_per_sequence(gemma, 2, 100) == formulas.kv_bytes_per_sequence(full, 2, 100)
    # At 32k tokens: 3 full layers hold 32,768 tokens, 15 sliding ones 512 each.
    expected = per_token / 18 * (3 * 32768 + 15 * 512)
    assert formulas.kv_bytes_per_sequence(gemma, 2, 32768) == pytest.approx(expected)
    assert formulas.kv_bytes_per_sequence(full, 2, 32768) == pytest.approx(per_token * 32768)
