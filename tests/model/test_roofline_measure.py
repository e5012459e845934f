"""A short real run of the roofline measurement against the offline engine and the real model:
prefill and decode points on SmolLM2 (fp32), checked against the shapes."""

from __future__ import annotations

import pytest

from tokios.engine import LLM
from tokios.tools.plan import formulas
from tokios.tools.roofline.roofs import BANDWIDTH_BOUND, Roofs, verdict
from tokios.tools.roofline.measure import (engine_footprint, measure_decode_utilization,
                                           measure_prefill_utilization)


@pytest.fixture(scope="module")
def engine():
    return LLM(model=None, dtype="float32", max_num_seqs=4, max_num_batched_tokens=256)


def test_footprint_matches_smollm2(engine):
    footprint = engine_footprint(engine)
    model = footprint.model
    assert (model.num_layers, model.hidden_size, model.num_heads, model.num_kv_heads,
            model.head_dim, model.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert footprint.kv_bytes_per_token > 0 and footprint.step_weight_bytes > 0


def test_short_prefill_and_decode_run(engine):
    footprint = engine_footprint(engine)
    prefill = measure_prefill_utilization(engine, [16, 48], num_repeats=1)
    decode = measure_decode_utilization(engine, [1, 4], prompt_len=16, num_steps=(2, 6), num_repeats=1)
    assert [p.num_tokens for p in prefill] == [16, 48]
    assert [p.batch_size for p in decode] == [1, 4]
    for point in prefill + decode:
        assert point.seconds > 0
    assert decode[1].flops == formulas.decode_step_flops(footprint.model, 4, 16 + 4)
    assert prefill[1].flops == formulas.prefill_flops(footprint.model, 48)
    # The design notes' roofs for this machine (25 GB/s, fp32 70 GFLOP/s): an fp32 batch-1
    # decode moves 4 bytes per 2 FLOPs, far left of the ridge at 2.8 FLOPs/byte.
    roofs = Roofs(25e9, 70e9, "fp32")
    assert verdict(decode[0], roofs).startswith(f"decode at batch 1: {BANDWIDTH_BOUND}, ")


def test_the_kernels_count_every_weight_byte_of_a_dense_decode_step_once():
    """The stored file on the quantized kernels: a decode step, fused or not, at any batch, reads
    every linear weight and the output head once, as their counters say."""
    engine = LLM(model=None, max_num_seqs=4, max_num_batched_tokens=256)
    decode = measure_decode_utilization(engine, [1, 3], prompt_len=16, num_steps=(2, 5), num_repeats=1)
    for point in decode:
        assert point.weight_bytes_counted == engine.weight_bytes()
        assert point.weight_bytes_estimated == engine.weight_bytes()
    assert engine.stats().weight_bytes_read == engine.weight_bytes_read() > 0  # /metrics' figure
