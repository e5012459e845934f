"""Roofline classification on known inputs, the verdict line, and the chart file."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError
from tokios.tools.plan import formulas
from tokios.tools.plan.model_presets import NAME_TO_PRESET
from tokios.tools.roofline.roofs import (BANDWIDTH_BOUND, COMPUTE_BOUND, Roofs, RooflinePoint, classify,
                                         decode_regime, verdict)
from tokios.tools.roofline.chart import draw_roofline_chart

# The design notes' figures for this machine: 25 GB/s, bf16 360 GFLOP/s -> ridge 14.4 FLOPs/byte.
THIS_MACHINE = Roofs(memory_bandwidth=25e9, peak_flops=360e9, dtype="bf16")
SMOLLM = NAME_TO_PRESET["smollm2-135m"]
Q4_1_STEP_BYTES = formulas.step_weight_bytes(SMOLLM, 5.0)
KV_PER_TOKEN = formulas.kv_bytes_per_token(SMOLLM, 2)


def test_ridge_and_classification_on_known_inputs():
    assert THIS_MACHINE.ridge_intensity == pytest.approx(14.4)
    low = classify(flops=1e9, bytes_moved=1e9, roofs=THIS_MACHINE)
    assert low.regime == BANDWIDTH_BOUND and low.arithmetic_intensity == 1.0
    assert low.bound_seconds == pytest.approx(1e9 / 25e9)
    high = classify(flops=100e9, bytes_moved=1e9, roofs=THIS_MACHINE)
    assert high.regime == COMPUTE_BOUND
    assert high.bound_seconds == pytest.approx(100e9 / 360e9)


def test_batch1_decode_is_bandwidth_bound_and_large_batches_turn_compute_bound():
    def regime(batch_size: int) -> str:
        return decode_regime(SMOLLM, THIS_MACHINE, batch_size=batch_size, context_len=64,
                             step_weight_bytes=Q4_1_STEP_BYTES, kv_bytes_per_token=KV_PER_TOKEN).regime

    assert regime(1) == BANDWIDTH_BOUND
    assert regime(64) == COMPUTE_BOUND
    ridge = formulas.decode_ridge_batch_size(SMOLLM, Q4_1_STEP_BYTES, KV_PER_TOKEN, 64,
                                             THIS_MACHINE.peak_flops, THIS_MACHINE.memory_bandwidth)
    assert regime(int(ridge)) == BANDWIDTH_BOUND
    assert regime(int(ridge) + 1) == COMPUTE_BOUND


@given(flops=st.floats(1e3, 1e15), bytes_moved=st.floats(1e3, 1e12))
def test_regime_is_the_side_of_the_ridge_and_the_bound_is_the_slower_roof(flops, bytes_moved):
    result = classify(flops, bytes_moved, THIS_MACHINE)
    is_compute = flops / bytes_moved >= THIS_MACHINE.ridge_intensity
    assert result.regime == (COMPUTE_BOUND if is_compute else BANDWIDTH_BOUND)
    expected = flops / 360e9 if is_compute else bytes_moved / 25e9
    assert result.bound_seconds == pytest.approx(expected)


def test_verdict_names_the_regime_and_the_share_of_the_limiting_roof():
    seconds = 0.01
    bandwidth_point = RooflinePoint("decode", 1, 1, 64, flops=0.2e9, bytes_moved=0.61 * 25e9 * seconds,
                                    seconds=seconds)
    assert verdict(bandwidth_point, THIS_MACHINE) == \
        "decode at batch 1: bandwidth-bound, 61% of peak bandwidth"
    compute_point = RooflinePoint("prefill", 1, 512, 512, flops=0.5 * 360e9 * seconds, bytes_moved=1e6,
                                  seconds=seconds)
    assert verdict(compute_point, THIS_MACHINE) == \
        "prefill of 512 tokens: compute-bound, 50% of peak bf16 FLOP/s"
    summary = compute_point.summary(THIS_MACHINE)
    assert summary["percent_of_peak_flops"] == pytest.approx(50)
    assert summary["percent_of_roofline"] == pytest.approx(50)
    assert summary["tokens_per_s"] == pytest.approx(512 / seconds)


def test_bad_roofs_and_work_are_rejected():
    with pytest.raises(InvalidRequestError, match="memory_bandwidth"):
        Roofs(memory_bandwidth=0, peak_flops=1e9)
    with pytest.raises(InvalidRequestError, match="bytes_moved"):
        classify(1e9, 0, THIS_MACHINE)
    with pytest.raises(InvalidRequestError, match="batch_size"):
        decode_regime(SMOLLM, THIS_MACHINE, batch_size=0, context_len=1,
                      step_weight_bytes=1.0, kv_bytes_per_token=1.0)


def test_chart_is_a_png(tmp_path):
    points = [RooflinePoint("decode", b, b, 48, flops=formulas.decode_step_flops(SMOLLM, b, 48),
                            bytes_moved=formulas.decode_step_bytes(Q4_1_STEP_BYTES, KV_PER_TOKEN, b, 48),
                            seconds=0.01 + 0.001 * b) for b in (1, 4, 16)]
    points.append(RooflinePoint("prefill", 1, 256, 256, flops=formulas.prefill_flops(SMOLLM, 256),
                                bytes_moved=Q4_1_STEP_BYTES, seconds=0.5))
    roofs = [THIS_MACHINE, Roofs(25e9, 70e9, "fp32")]
    path = draw_roofline_chart(roofs, points, tmp_path / "chart" / "roofline.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert (width, height) == (960, 660)


def test_roofline_command_measures_roofs_and_writes_the_chart(tmp_path):
    import json
    import os
    import subprocess
    import sys

    chart = tmp_path / "roofs.png"
    env = {**os.environ, "TOKIOS_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-m", "tokios.cli", "roofline", "--skip-engine", "--quick",
                             "--json", "--chart", str(chart)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    measurement = report["measurement"]
    assert measurement["memory_bandwidth"] > 0
    assert set(measurement["dtype_to_peak_flops"]) >= {"fp32", "bf16"}
    assert report["points"] == [] and chart.read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "cache" / "hardware.json").exists()  # quick figures are never cached


def test_the_int8_roof_is_at_least_what_our_quantized_kernel_does(monkeypatch):
    """The int8 roof holds the quantized engine's steps; where oneDNN's integer GEMM has no vector
    path (1.3 GFLOP/s on an AVX2 host) it must come from our kernel, or every decode step reads
    as thousands of percent of peak."""
    from tokios.model.kernels import has_vector_kernels, load_extension
    from tokios.tools.roofline import microbench

    extension = load_extension()
    if extension is None or not has_vector_kernels(extension):
        pytest.skip("the kernel has no vector path here")
    assert microbench._measure_quantized_kernel_flops(256, num_repeats=1) > 0  # the real kernel runs
    # The roof is the larger figure: a kernel far beyond any integer GEMM is taken as it is.
    monkeypatch.setattr(microbench, "_measure_quantized_kernel_flops", lambda size, num_repeats: 1e18)
    assert microbench.measure_matmul_flops("int8", 256, num_repeats=1) == 1e18
    assert microbench.measure_matmul_flops("int8", 256, num_repeats=1, with_kernels=False) < 1e18
