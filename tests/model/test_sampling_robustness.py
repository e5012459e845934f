"""Extreme but valid sampling parameters never crash a step, and a request whose row still goes
wrong fails alone (issue 16, docs/reliability.md).

Two levels, both property tests over the ranges SamplingParams accepts, edges and denormals
included (5e-324 as a repetition penalty was the value that once crashed the step and aborted
every other request in flight):

- the sampler on random logits in a mixed batch: it never raises, every token is in range, and
  a row is flagged invalid exactly when it has nothing to sample (every token suppressed, or a
  nan in the model's logits);
- the real engine (AsyncEngine on the default model): a fuzzed request runs beside an innocent
  greedy one; the fuzzed one finishes or fails with its own error, the innocent one always gives
  the text it gives alone, and afterwards no KV block is held.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tokios.errors import InvalidRequestError, TokiosError
from tokios.sampler import Sampler, SamplingMetadata, compute_processed_probs
from tokios.sampling_params import SamplingParams

TOY_VOCAB_SIZE = 64
TOY_EOS_ID = 2
NAN_TOKEN_ID = 3
DENORMAL = 5e-324


def edge_floats(low: float, high: float, *, exclude_low: bool = False) -> st.SearchStrategy[float]:
    """Floats in the accepted range, with the edges, denormals and near-edge values drawn often."""
    edges = [value for value in (low, high, DENORMAL, 1e-300, 1e-38, 1e-5, 1.1e-5, 0.999999, 1.0, 1e30, 1e300)
             if low <= value <= high and not (exclude_low and value == low)]
    return st.one_of(st.sampled_from(edges),
                     st.floats(low, high, allow_nan=False, allow_infinity=False, exclude_min=exclude_low))


@st.composite
def sampling_params(draw, vocab_size: int, max_tokens: int) -> SamplingParams:
    """Any SamplingParams validation accepts (within `vocab_size`), edges weighted."""
    options = {}
    if draw(st.booleans()):
        options["temperature"] = draw(edge_floats(0.0, 1e300))
    if draw(st.booleans()):
        options["top_p"] = draw(edge_floats(0.0, 1.0, exclude_low=True))
    if draw(st.booleans()):
        options["top_k"] = draw(st.one_of(st.sampled_from([-1, 0, 1, 2, vocab_size, vocab_size + 1, 10**9]),
                                          st.integers(-1, vocab_size)))
    if draw(st.booleans()):
        options["min_p"] = draw(edge_floats(0.0, 1.0))
    if draw(st.booleans()):
        options["repetition_penalty"] = draw(edge_floats(0.0, 1e300, exclude_low=True))
    if draw(st.booleans()):
        options["frequency_penalty"] = draw(edge_floats(-2.0, 2.0))
        options["presence_penalty"] = draw(edge_floats(-2.0, 2.0))
    bias_kind = draw(st.sampled_from(["none", "some", "all_but_one"]))
    if bias_kind == "some":
        options["logit_bias"] = draw(st.dictionaries(st.integers(0, vocab_size - 1), edge_floats(-100.0, 100.0),
                                                     max_size=8))
    elif bias_kind == "all_but_one":
        kept = draw(st.integers(0, vocab_size - 1))
        options["logit_bias"] = {token_id: -100.0 for token_id in range(vocab_size) if token_id != kept}
    stop_kind = draw(st.sampled_from(["none", "some", "whole_vocabulary"]))
    if stop_kind == "some":
        options["stop_token_ids"] = draw(st.lists(st.integers(0, vocab_size - 1), max_size=4))
    elif stop_kind == "whole_vocabulary":
        options["stop_token_ids"] = list(range(vocab_size))
    options["min_tokens"] = draw(st.integers(0, max_tokens))
    if draw(st.booleans()):
        options["seed"] = draw(st.sampled_from([0, -(2**63), 2**64 - 1, 7]))
    if draw(st.booleans()):
        options["logprobs"] = draw(st.integers(0, 20))
    return SamplingParams(max_tokens=max_tokens, ignore_eos=draw(st.booleans()), **options)


def everything_suppressed(params: SamplingParams, vocab_size: int, eos_id: int, num_output_tokens: int) -> bool:
    suppressed = set(params.stop_token_ids or ()) | {eos_id}
    return num_output_tokens < params.min_tokens and len(suppressed) >= vocab_size


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(sampling_params(TOY_VOCAB_SIZE, max_tokens=3), min_size=1, max_size=5),
       nan_row=st.one_of(st.none(), st.integers(0, 4)), num_output_tokens=st.integers(0, 3),
       logit_scale=st.sampled_from([1.0, 30.0, 1e30]), seed=st.integers(0, 2**16))
def test_the_sampler_never_raises_and_flags_exactly_the_rows_with_nothing_to_sample(
        batch, nan_row, num_output_tokens, logit_scale, seed):
    generator = torch.Generator().manual_seed(seed)
    num_rows = len(batch)
    logits = torch.randn(num_rows, TOY_VOCAB_SIZE, generator=generator) * logit_scale
    if nan_row is not None and nan_row < num_rows:
        logits[nan_row, NAN_TOKEN_ID] = math.nan
    outputs = [[(5 * i + j) % TOY_VOCAB_SIZE for j in range(num_output_tokens)] for i in range(num_rows)]
    suppress = [frozenset(set(p.stop_token_ids or ()) | {TOY_EOS_ID}) if num_output_tokens < p.min_tokens
                else frozenset() for p in batch]
    metadata = SamplingMetadata.build(batch, [[1, 4, 9]] * num_rows, outputs, [None] * num_rows, suppress,
                                      TOY_VOCAB_SIZE, "cpu")
    result = Sampler()(logits, metadata)
    # A suppressed token's logit becomes -inf whatever it was, so a nan there is overwritten.
    expected_valid = [not ((row == nan_row and NAN_TOKEN_ID not in suppress[row])
                           or everything_suppressed(p, TOY_VOCAB_SIZE, TOY_EOS_ID, num_output_tokens))
                      for row, p in enumerate(batch)]
    assert result.row_is_valid.tolist() == expected_valid
    token_ids = result.sampled_token_ids.tolist()
    assert all(0 <= token_id < TOY_VOCAB_SIZE for token_id in token_ids)
    for row, token_id in enumerate(token_ids):
        if expected_valid[row] and suppress[row]:
            assert token_id not in suppress[row]  # a valid row never emits a suppressed token
    # The speculative path's distribution: a valid row has mass, an invalid one none.
    probs = compute_processed_probs(logits, metadata)
    assert ((probs.sum(dim=-1) > 0).tolist()) == expected_valid


# ---- the real engine ------------------------------------------------------------------------

INNOCENT_PROMPT = "The capital of France is"
INNOCENT_PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    from tokios.config import CacheConfig, EngineConfig
    from tokios.engine import AsyncEngine

    return AsyncEngine(EngineConfig(cache=CacheConfig(kv_cache_memory_bytes=32 * 1024**2)))


async def collect(engine, prompt: str, params: SamplingParams, request_id: str):
    final = None
    async for output in engine.generate(prompt, params, request_id=request_id):
        final = output
    return final


@pytest.fixture(scope="module")
def innocent_alone(engine):
    return asyncio.run(collect(engine, INNOCENT_PROMPT, INNOCENT_PARAMS, "alone")).outputs[0].text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(params=sampling_params(49152, max_tokens=3))
def test_a_fuzzed_request_beside_an_innocent_one_never_breaks_the_step(engine, innocent_alone, params):
    assume(params.logit_bias is None or len(params.logit_bias) < 49151)  # 49k-entry dicts: the unit test's job

    async def run_pair():
        return await asyncio.gather(collect(engine, INNOCENT_PROMPT, INNOCENT_PARAMS, "innocent"),
                                    collect(engine, "Hello, hello, hello there", params, "fuzzed"),
                                    return_exceptions=True)

    innocent, fuzzed = asyncio.run(run_pair())
    assert not isinstance(innocent, BaseException), innocent
    assert innocent.outputs[0].text == innocent_alone
    if isinstance(fuzzed, BaseException):
        # Only a request whose settings leave nothing to sample may fail, and with its own 400.
        assert isinstance(fuzzed, InvalidRequestError) and fuzzed.code == "no_token_to_sample", fuzzed
        assert params.min_tokens > 0 and params.stop_token_ids and len(set(params.stop_token_ids)) >= 49151
    else:
        assert fuzzed.finished and all(0 <= t < 49152 for t in fuzzed.outputs[0].token_ids)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_a_request_with_nothing_to_sample_fails_alone_with_a_400(engine, innocent_alone):
    everything_stops = SamplingParams(max_tokens=3, min_tokens=2, stop_token_ids=list(range(49152)))

    async def run_pair():
        return await asyncio.gather(collect(engine, INNOCENT_PROMPT, INNOCENT_PARAMS, "innocent"),
                                    collect(engine, "Hi", everything_stops, "doomed"), return_exceptions=True)

    innocent, doomed = asyncio.run(run_pair())
    assert innocent.outputs[0].text == innocent_alone
    assert isinstance(doomed, InvalidRequestError) and isinstance(doomed, TokiosError) and doomed.status == 400
    assert "no token that can be sampled" in doomed.message
    engine.check_invariants()
