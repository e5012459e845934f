"""`tokios bench fairness`'s arithmetic: which inter-token gaps fall before and during the long
prompt's prefill, and the --max-step-ms values it accepts (the server's own parser)."""

from __future__ import annotations

import argparse

import pytest

from tokios.errors import InvalidRequestError
from tokios.engine_flags import parse_step_budget
from tokios.tools.bench.fairness import (FairnessRound, gap_indices, gaps_at, parse_step_budgets, result_table,
                                         split_gaps)
from tokios.tools.bench.stats import RequestRecord


def record(times: list[float]) -> RequestRecord:
    return RequestRecord(start_time=0.0, chunk_times=times, is_success=True)


def test_gaps_are_split_where_they_end_and_never_include_a_prefill():
    # Stream a decodes from t=1; stream b's first token comes during the long prefill (4..6).
    streams = [record([1.0, 1.5, 2.0, 4.5, 5.0, 7.0]), record([5.5, 5.6])]
    before, during = split_gaps(streams, long_sent=4.0, long_first_token=6.0)
    assert before == pytest.approx([500.0, 500.0])
    assert during == pytest.approx([2500.0, 500.0, 100.0])  # the 2.0 -> 4.5 gap ends during the prefill


def test_without_it_is_the_control_gaps_at_the_chunks_that_fell_during_the_prefill():
    """The control (the streams alone) is compared at the same chunk positions, so at the same
    contexts, not at the same clock times."""
    streams = [record([1.0, 1.5, 2.0, 4.5, 5.0, 7.0]), record([5.5, 5.6])]
    indices = gap_indices(streams, 4.0, 6.0)
    assert indices == [[3, 4], [1]]
    control = [record([0.0, 0.1, 0.2, 0.3, 0.5, 0.6]), record([0.0])]  # the second ended after one chunk
    assert gaps_at(control, indices) == pytest.approx([100.0, 200.0])
    result = FairnessRound(itl_before_ms=[10.0] * 100, itl_during_ms=[30.0] * 100, long_ttft_s=2.0,
                           streams_ended_early=0, during_gap_indices=indices, itl_without_ms=[20.0] * 100)
    row = result_table({"tokios": [result]}).splitlines()[-1]
    assert "| 20.0 | 3.00x | 1.50x |" in row


def test_a_round_reports_percentiles_and_nan_without_samples():
    result = FairnessRound(itl_before_ms=[10.0] * 99 + [50.0], itl_during_ms=[], long_ttft_s=3.0,
                           streams_ended_early=0)
    assert result.figure("before p50") == 10.0 and result.figure("before p99") > 10.0
    assert result.figure("ttft") == 3.0
    assert result.figure("during p99") != result.figure("during p99")  # NaN


@pytest.mark.parametrize(("text", "value"), [("auto", "auto"), ("off", None), ("250", 250.0), ("0.5", 0.5)])
def test_step_budgets_the_server_accepts(text, value):
    assert parse_step_budget(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "fast", "nan", ""])
def test_step_budgets_the_server_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError, match="positive number of milliseconds"):
        parse_step_budget(text)


def test_the_benchmark_checks_every_budget_before_starting_a_server():
    assert parse_step_budgets("auto, off,100") == ["auto", "off", "100"]
    with pytest.raises(InvalidRequestError, match="fast"):
        parse_step_budgets("auto,fast")
    # A value may carry more server flags after its budget.
    assert parse_step_budgets("auto,auto  --no-prefill-layer-slices") == ["auto", "auto --no-prefill-layer-slices"]
    with pytest.raises(InvalidRequestError, match="fast"):
        parse_step_budgets("fast --no-prefill-layer-slices")
