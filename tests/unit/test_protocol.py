"""Request bodies: validation, normalization and the mapping to SamplingParams."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokios.errors import InvalidRequestError
from tokios.sampling_params import SamplingParams
from tokios.server.dialects.openai.protocol import (ChatCompletionRequest, CompletionRequest, TokenizeRequest, parse_logit_bias,
                                    sampling_kwargs)
from tokios.server.serving import make_sampling_params

VOCAB_SIZE = 49152


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_chat_defaults_leave_sampling_params_defaults_alone():
    kwargs = sampling_kwargs(chat(), max_tokens=10, vocab_size=VOCAB_SIZE)
    assert kwargs == {"n": 1, "max_tokens": 10, "ignore_eos": False, "skip_special_tokens": True,
                      "include_stop_str_in_output": False}
    params = make_sampling_params(kwargs)
    assert params.temperature == SamplingParams().temperature
    assert params.max_tokens == 10


def test_every_openai_and_extension_field_reaches_sampling_params():
    request = chat(n=2, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, seed=7, stop=["\n", "END"],
                   frequency_penalty=0.5, presence_penalty=-0.5, repetition_penalty=1.1, min_tokens=2,
                   logprobs=True, top_logprobs=3, logit_bias={"42": -100, "7": 2.5}, ignore_eos=True,
                   stop_token_ids=[2], skip_special_tokens=False, include_stop_str_in_output=True)
    params = make_sampling_params(sampling_kwargs(request, max_tokens=20, vocab_size=VOCAB_SIZE))
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == (
        2, 0.5, 0.9, 40, 0.05, 7)
    assert params.stop == ["\n", "END"]
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.5, -0.5, 1.1)
    assert (params.min_tokens, params.max_tokens, params.logprobs) == (2, 20, 3)
    assert params.logit_bias == {42: -100.0, 7: 2.5}
    assert params.ignore_eos and params.include_stop_str_in_output and not params.skip_special_tokens
    assert params.stop_token_ids == [2]
    assert params.prompt_logprobs is None


def test_logprobs_true_without_top_logprobs_asks_for_the_sampled_token_only():
    assert sampling_kwargs(chat(logprobs=True), max_tokens=1, vocab_size=VOCAB_SIZE)["logprobs"] == 0
    assert "logprobs" not in sampling_kwargs(chat(), max_tokens=1, vocab_size=VOCAB_SIZE)


def test_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5, max_completion_tokens=9).requested_max_tokens == 9
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat().requested_max_tokens is None


def test_stop_is_normalized_to_a_list_and_empty_strings_are_refused():
    assert chat(stop="x").stop == ["x"]
    with pytest.raises(ValidationError) as info:
        chat(stop=["ok", ""])
    assert info.value.errors()[0]["loc"][0] == "stop"


def test_top_logprobs_without_logprobs_is_refused_by_name():
    with pytest.raises(InvalidRequestError) as info:
        chat(top_logprobs=2).check_supported()
    assert info.value.param == "top_logprobs"


@pytest.mark.parametrize("fields, kind", [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, "json_object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, "json"),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
    ({"structured_outputs": {"grammar": "start: \"x\""}}, "grammar"),
    ({"structured_outputs": {"json": '{"type": "string"}'}}, "json"),
])
def test_structured_output_fields_become_one_constraint(fields, kind):
    structured = chat(**fields).structured_output()
    assert (structured.kind if structured else None) == kind


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
])
def test_malformed_structured_output_is_refused_by_name(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        chat(**fields).structured_output()
    assert info.value.param == param


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"n": 0}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"temperature": "hot"}, "temperature"),
])
def test_malformed_fields_fail_validation_at_their_location(fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert info.value.errors()[0]["loc"][0] == param


def test_content_parts_are_joined_and_non_text_parts_refused():
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                          {"type": "text", "text": "b"}]}])
    assert request.messages_as_dicts() == [{"role": "user", "content": "a\nb"}]
    image = chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequestError) as info:
        image.messages_as_dicts()
    assert info.value.param == "messages"


@pytest.mark.parametrize("prompt, expected", [
    ("hello", ["hello"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_completion_prompt_shapes(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("prompt", [[], [[1], []]])
def test_empty_completion_prompts_are_refused(prompt):
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": prompt}).prompts()
    assert info.value.param == "prompt"


def test_mixed_prompt_list_is_a_validation_error():
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": ["a", 1]})


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    request = CompletionRequest.model_validate({"prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 1})
    kwargs = sampling_kwargs(request, max_tokens=1, vocab_size=VOCAB_SIZE)
    assert kwargs["prompt_logprobs"] == 1 and kwargs["logprobs"] == 1
    plain = CompletionRequest.model_validate({"prompt": "x", "logprobs": 2})
    assert "prompt_logprobs" not in sampling_kwargs(plain, max_tokens=1, vocab_size=VOCAB_SIZE)


def test_max_tokens_zero_needs_echo():
    CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0}).check_supported()
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": 0}).check_supported()
    assert info.value.param == "max_tokens"


@pytest.mark.parametrize("logit_bias, message_part", [
    ({"abc": 1}, "token ids"),
    ({"49152": 1}, "out of range 0..49151"),
    ({"-1": 1}, "out of range"),
    ({"5": 101}, "-100..100"),
])
def test_logit_bias_errors_name_the_field_and_range(logit_bias, message_part):
    with pytest.raises(InvalidRequestError) as info:
        parse_logit_bias(logit_bias, VOCAB_SIZE)
    assert info.value.param == "logit_bias"
    assert message_part in info.value.message


def test_out_of_range_values_become_invalid_request_naming_the_field():
    kwargs = sampling_kwargs(chat(temperature=-1.0), max_tokens=4, vocab_size=VOCAB_SIZE)
    with pytest.raises(InvalidRequestError) as info:
        make_sampling_params(kwargs)
    assert info.value.param == "temperature"
    assert info.value.status == 400


def test_speculative_hint_is_accepted_without_changing_sampling():
    kwargs = sampling_kwargs(chat(speculative={"method": "ngram", "num_tokens": 3}), max_tokens=4,
                             vocab_size=VOCAB_SIZE)
    assert kwargs["speculative"] == {"method": "ngram", "num_tokens": 3}
    assert make_sampling_params(kwargs).max_tokens == 4


def test_tokenize_needs_exactly_one_of_prompt_and_messages():
    with pytest.raises(InvalidRequestError):
        TokenizeRequest.model_validate({}).check_supported()
    with pytest.raises(InvalidRequestError):
        TokenizeRequest.model_validate({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}
                                       ).check_supported()
    TokenizeRequest.model_validate({"prompt": "a"}).check_supported()


@pytest.mark.parametrize("field, value", [("n", True), ("max_tokens", False), ("temperature", True),
                                          ("logit_bias", {"5": True}), ("top_logprobs", True)])
def test_a_boolean_where_a_number_belongs_is_refused_by_name(field, value):
    # pydantic's lax mode read true as 1: fuzzing found `"n": true` answered with 200.
    with pytest.raises(ValidationError, match=f"{field}(.5)?\n.*not a boolean"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], field: value})
    assert ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 256.0}).max_tokens == 256
