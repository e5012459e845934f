"""tools/bench/stats.py: percentiles, per-request latencies and the serving summary, on hand-made records."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokios.tools.bench.stats import (
    RepeatedFigure,
    RequestRecord,
    peak_concurrency,
    percentile,
    ratio,
    summarize_serve,
)


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=50),
       st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy_linear(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_percentile_of_nothing_is_nan_and_q_is_checked():
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be in 0..100"):
        percentile([1.0], 101)


def test_repeated_figure_and_ratio():
    figure = RepeatedFigure.of([10.0, 30.0, 20.0, 50.0, 40.0])
    assert (figure.median, figure.num_reps) == (30.0, 5)
    assert figure.p5 == pytest.approx(12.0)
    assert figure.p95 == pytest.approx(48.0)
    assert ratio(30.0, 15.0) == 2.0
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0))


def test_request_record_latencies():
    record = RequestRecord(start_time=10.0, end_time=11.0, is_success=True,
                           chunk_times=[10.2, 10.4, 10.6, 11.0], num_output_tokens=5)
    assert record.ttft_s == pytest.approx(0.2)
    assert record.e2e_latency_s == pytest.approx(1.0)
    # (1.0 - 0.2) over the 4 tokens after the first, whatever the chunking.
    assert record.tpot_s == pytest.approx(0.2)
    assert record.itls_s == pytest.approx([0.2, 0.2, 0.4])
    single = RequestRecord(start_time=0.0, end_time=1.0, chunk_times=[0.5], num_output_tokens=1)
    assert math.isnan(single.tpot_s)


def test_peak_concurrency_counts_overlap_only():
    records = [RequestRecord(0.0, 2.0), RequestRecord(1.0, 3.0), RequestRecord(2.0, 4.0), RequestRecord(2.5, 2.6)]
    # At 2.5: requests 2, 3 and 4 are in flight (request 1 ended exactly when 3 started).
    assert peak_concurrency(records) == 3
    assert peak_concurrency([]) == 0


def test_summarize_serve_counts_only_completed_requests():
    ok = RequestRecord(0.0, 2.0, is_success=True, chunk_times=[0.5, 1.0, 2.0], num_prompt_tokens=10,
                       num_output_tokens=3)
    ok2 = RequestRecord(0.0, 4.0, is_success=True, chunk_times=[1.5, 4.0], num_prompt_tokens=20,
                        num_output_tokens=2)
    failed = RequestRecord(0.0, 0.1, error="HTTP 500: boom")
    summary = summarize_serve("c=2", [ok, ok2, failed], duration_s=4.0)
    assert (summary.num_completed, summary.num_failed) == (2, 1)
    assert (summary.total_input_tokens, summary.total_output_tokens) == (30, 5)
    assert summary.request_throughput == pytest.approx(0.5)
    assert summary.output_throughput == pytest.approx(1.25)
    assert summary.total_token_throughput == pytest.approx(35 / 4)
    assert summary.ttft.mean_ms == pytest.approx(1000.0)
    assert summary.ttft.median_ms == pytest.approx(1000.0)
    assert summary.tpot.mean_ms == pytest.approx((750.0 + 2500.0) / 2)
    assert summary.itl.median_ms == pytest.approx(1000.0)  # gaps 0.5, 1.0, 2.5
    assert summary.e2e_latency.p99_ms == pytest.approx(3980.0)
    assert summary.peak_concurrency == 3
    assert summary.errors == ["HTTP 500: boom"]
    with pytest.raises(ValueError, match="duration_s"):
        summarize_serve("x", [ok], duration_s=0.0)
