"""SamplingParams validation: every bad value is an InvalidRequestError naming the field and range."""

from __future__ import annotations

import math

import pytest

from tokios.errors import InvalidRequestError
from tokios.sampling_params import SamplingParams

# (field, bad value, a fragment of the allowed range the message must state)
BAD_VALUES = [
    ("n", 0, "[1, 128]"),
    ("n", 129, "[1, 128]"),
    ("n", 2.5, "[1, 128]"),
    ("n", True, "[1, 128]"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", math.nan, ">= 0"),
    ("temperature", math.inf, ">= 0"),
    ("temperature", "hot", ">= 0"),
    ("temperature", None, ">= 0"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.01, "(0, 1]"),
    ("top_p", "0.5", "(0, 1]"),
    ("top_k", -2, ">= 1, or 0 or -1"),
    ("top_k", 3.5, ">= 1, or 0 or -1"),
    ("min_p", -0.01, "[0, 1]"),
    ("min_p", 1.5, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("frequency_penalty", 2.01, "[-2, 2]"),
    ("frequency_penalty", -2.5, "[-2, 2]"),
    ("presence_penalty", 3, "[-2, 2]"),
    ("presence_penalty", -2.01, "[-2, 2]"),
    ("logit_bias", {5: 100.5}, "[-100, 100]"),
    ("logit_bias", {5: -101}, "[-100, 100]"),
    ("logit_bias", {-1: 1.0}, ">= 0"),
    ("logit_bias", {"abc": 1.0}, ">= 0"),
    ("logit_bias", [1, 2], "[-100, 100]"),
    ("seed", 2**64, "[-9223372036854775808, 18446744073709551615]"),
    ("seed", "42", "[-9223372036854775808, 18446744073709551615]"),
    ("max_tokens", 0, ">= 1"),
    ("max_tokens", 1.5, ">= 1"),
    ("min_tokens", -1, ">= 0"),
    ("stop", "", "non-empty string"),
    ("stop", ["ok", ""], "non-empty string"),
    ("stop", [1], "non-empty string"),
    ("stop_token_ids", [3, -1], ">= 0"),
    ("stop_token_ids", "3", ">= 0"),
    ("ignore_eos", "yes", "boolean"),
    ("skip_special_tokens", 1, "boolean"),
    ("include_stop_str_in_output", None, "boolean"),
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", -1, "[0, 20]"),
    ("prompt_logprobs", 21, "[0, 20]"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD_VALUES)
def test_bad_value_names_field_and_range(field, value, allowed):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert field in info.value.message
    assert allowed in info.value.message
    assert info.value.status == 400


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.param == "min_tokens"
    assert "[0, max_tokens=4]" in info.value.message
    assert SamplingParams(max_tokens=None, min_tokens=500).min_tokens == 500


def test_defaults_match_openai_and_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.repetition_penalty, params.frequency_penalty, params.presence_penalty) == (1.0, 0.0, 0.0)
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.logit_bias is None and params.seed is None and params.stop is None
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and not params.ignore_eos and not params.include_stop_str_in_output
    assert not params.is_greedy and not params.has_penalties


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, temperature=1, logit_bias={"50": 2, 7: -1.5})
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert isinstance(params.temperature, float)
    assert params.logit_bias == {50: 2.0, 7: -1.5}


def test_is_greedy():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.7, top_k=1).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy


def test_validate_for_vocab():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).validate_for_vocab(100)
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    assert info.value.param == "logit_bias" and "[0, 99]" in info.value.message
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[5, 100]).validate_for_vocab(100)
    assert info.value.param == "stop_token_ids" and "[0, 99]" in info.value.message


def test_clone_is_deep_and_for_child_spreads_seeds():
    params = SamplingParams(n=3, seed=7, stop=["a"], logit_bias={1: 1.0})
    copy = params.clone()
    copy.stop.append("b")
    copy.logit_bias[2] = 2.0
    assert params.stop == ["a"] and params.logit_bias == {1: 1.0}
    children = [params.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [7, 8, 9]
    assert all(c.n == 1 for c in children)
    assert SamplingParams(seed=2**64 - 1).for_child(1).seed == -(2**63)
    assert SamplingParams().for_child(2).seed is None


def test_a_top_k_past_any_vocabulary_keeps_every_token_and_fits_the_sampler():
    # Found by fuzzing: top_k 6.4e29 overflowed the sampler's int64 tensor and failed the step.
    from tokios.sampling_params import MAX_TOP_K

    assert SamplingParams(top_k=644028832741599229111458332672).top_k == MAX_TOP_K
    assert SamplingParams(top_k=40).top_k == 40
