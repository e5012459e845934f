"""`tokios bench capacity`'s own arithmetic: which variants it accepts, how many whole streams
each server's allocation holds in a memory, and reading the servers' running gauges."""

from __future__ import annotations

import pytest

from tokios.errors import InvalidRequestError
from tokios.tools.bench.capacity import Variant, metric_value, parse_variants, streams_that_fit


def test_variants_name_a_server_and_one_of_its_cache_types():
    assert parse_variants("tokios:int8, llama.cpp:q8_0") == [Variant("tokios", "int8"), Variant("llama.cpp", "q8_0")]
    with pytest.raises(InvalidRequestError, match="'tokios:q8_0' is not one of"):
        parse_variants("tokios:q8_0")
    with pytest.raises(InvalidRequestError, match="lists nothing"):
        parse_variants(" , ")


def test_streams_that_fit_follow_each_servers_allocation():
    mib = 2**20
    # SmolLM2 at 4,096 tokens: bf16 23,040 bytes a token, int8 and q8_0 12,240.
    assert streams_that_fit(Variant("tokios", "bfloat16"), 256 * mib, 23_040, 4096) == 2
    assert streams_that_fit(Variant("tokios", "int8"), 256 * mib, 12_240, 4096) == 5
    assert streams_that_fit(Variant("llama.cpp", "q8_0"), 256 * mib, 12_240, 4096) == 5
    # A context that is not whole blocks costs tokios its last partial block in full.
    assert streams_that_fit(Variant("tokios", "int8"), 100 * 16 * 1000, 1000, 17) == 50


def test_metric_value_sums_labelled_samples_and_ignores_other_names():
    text = ('# HELP tokios:num_requests_running Requests\n'
            'tokios:num_requests_running{model_name="a"} 3.0\n'
            'tokios:num_requests_running{model_name="b"} 2.0\n'
            'tokios:num_requests_running_total 9\n'
            'llamacpp:requests_processing 4\n')
    assert metric_value(text, "tokios:num_requests_running") == 5.0
    assert metric_value(text, "llamacpp:requests_processing") == 4.0
    assert metric_value(text, "tokios:num_preemptions_total") is None
