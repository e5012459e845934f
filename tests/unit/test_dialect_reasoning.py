"""Reasoning in the Responses, Anthropic and Ollama translations: what each request asks of the
thinking (its ThinkingRequest, or a 400 naming the field), and a prior turn's thinking sent back
in each dialect's shape becoming the assistant turn's reasoning_content (the end-to-end answers
are in tests/e2e/test_server_reasoning.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tokios.errors import InvalidRequestError
from tokios.reasoning import ThinkingRequest
from tokios.server.dialects.anthropic import MessagesRequest, to_messages, to_thinking
from tokios.server.dialects.ollama import OllamaChatRequest, _messages, _thinking
from tokios.server.dialects.openai_responses import ResponsesRequest, _output_messages, input_messages
from tokios.server.dialects.openai_responses import _thinking as responses_thinking

QUESTION = {"role": "user", "content": "2+2?"}


# ---- Responses ----------------------------------------------------------------------------------

def test_responses_effort_and_budget_become_a_thinking_request():
    def thinking(**fields):
        return responses_thinking(ResponsesRequest.model_validate({"input": "hi", **fields}))

    assert thinking() == ThinkingRequest(None, None, None, "reasoning.effort")
    assert thinking(reasoning={"effort": "low", "summary": "auto"}) == ThinkingRequest(True, "low", None,
                                                                                       "reasoning.effort")
    assert thinking(reasoning={"effort": "none"}).is_enabled is False
    assert thinking(max_thinking_tokens=8).max_thinking_tokens == 8
    with pytest.raises(InvalidRequestError) as info:
        thinking(reasoning={"effort": "extreme"})
    assert info.value.param == "reasoning.effort"


def test_a_reasoning_item_sent_back_is_the_next_assistant_turns_reasoning():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Add them."}]}
    answer = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
    assert input_messages([QUESTION, reasoning, answer]) == [
        QUESTION, {"role": "assistant", "content": "4", "reasoning_content": "Add them."}]
    assert input_messages([QUESTION, reasoning, call])[1] == {
        "role": "assistant", "content": "", "reasoning_content": "Add them.",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}
    # Another server's item carries only encrypted_content: nothing to read, nothing kept.
    assert input_messages([QUESTION, {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "x"},
                           answer]) == [QUESTION, {"role": "assistant", "content": "4"}]


def test_a_stored_response_keeps_its_reasoning_for_previous_response_id():
    output = [{"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Hm."}]},
              {"type": "message", "id": "msg_1", "role": "assistant",
               "content": [{"type": "output_text", "text": "4"}]}]
    assert _output_messages(output) == [{"role": "assistant", "content": "4", "reasoning_content": "Hm."}]


# ---- Anthropic ----------------------------------------------------------------------------------

def anthropic_body(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 64, "messages": [QUESTION], **fields})


def test_anthropic_thinking_and_effort_become_a_thinking_request():
    assert to_thinking(anthropic_body()) == ThinkingRequest(param="thinking")
    assert to_thinking(anthropic_body(thinking={"type": "enabled", "budget_tokens": 16})) == ThinkingRequest(
        True, None, 16, "thinking")
    assert to_thinking(anthropic_body(thinking={"type": "adaptive"}, output_config={"effort": "medium"})) == \
        ThinkingRequest(True, "medium", None, "thinking")
    assert to_thinking(anthropic_body(output_config={"effort": "high"})) == ThinkingRequest(
        True, "high", None, "output_config.effort")
    assert to_thinking(anthropic_body(thinking={"type": "disabled"})).is_enabled is False


@pytest.mark.parametrize("fields, param", [
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, "thinking.budget_tokens"),  # not below max_tokens
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "between_tools"}}, "thinking.type"),
    ({"thinking": {}}, "thinking.type"),
    ({"thinking": {"type": "adaptive", "budget_tokens": "many"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 8, "display": "full"}}, "thinking.display"),
    ({"output_config": {"effort": "max"}}, "output_config.effort"),
    ({"thinking": {"type": "disabled"}, "output_config": {"effort": "low"}}, "output_config.effort"),
])
def test_anthropic_thinking_it_cannot_honour_is_a_400_naming_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as info:
        to_thinking(anthropic_body(**fields))
    assert info.value.param == param


def test_anthropic_thinking_blocks_sent_back_are_the_turns_reasoning():
    thinking = {"type": "thinking", "thinking": "Add them.", "signature": ""}
    call = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2}}
    body = anthropic_body(messages=[QUESTION, {"role": "assistant", "content": [
        thinking, {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "4"}]}])
    assert to_messages(body)[1] == {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
    body = anthropic_body(messages=[QUESTION, {"role": "assistant", "content": [thinking, call]}])
    assert to_messages(body)[1] == {"role": "assistant", "content": "", "reasoning_content": "Add them.",
                                    "tool_calls": [{"id": "toolu_1", "type": "function",
                                                    "function": {"name": "add", "arguments": {"a": 2}}}]}
    with pytest.raises(InvalidRequestError) as info:  # the user does not think aloud
        to_messages(anthropic_body(messages=[{"role": "user", "content": [thinking]}]))
    assert info.value.param == "messages.0.content.0"


# ---- Ollama -------------------------------------------------------------------------------------

def test_ollama_think_becomes_a_thinking_request():
    def thinking(think):
        return _thinking(OllamaChatRequest.model_validate({"model": "m", "think": think}))

    assert thinking(None) == ThinkingRequest(param="think")
    assert thinking(True) == ThinkingRequest(True, param="think")
    assert thinking(False) == ThinkingRequest(False, param="think")
    assert thinking("high") == ThinkingRequest(True, "high", param="think")
    with pytest.raises(InvalidRequestError) as info:
        thinking("max")
    assert info.value.param == "think"
    with pytest.raises(ValidationError):  # a JSON boolean, not a number standing for one
        thinking(1)


def test_ollama_thinking_of_a_prior_assistant_message_is_its_reasoning():
    body = OllamaChatRequest.model_validate({"model": "m", "messages": [
        QUESTION, {"role": "assistant", "content": "4", "thinking": "Add them."}]})
    assert _messages(body.messages)[1] == {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
