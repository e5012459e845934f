"""A reasoning model's thinking through the four chat APIs and their official clients (`openai`
chat and Responses, `anthropic`, `ollama`, and LangChain's Responses path), against
`thinking_server`: SmolLM2 under a template that opens `<think>`, so it thinks until a budget or
max_tokens ends it. Whole and streamed answers (same seed; Anthropic's API has no seed, so greedy)
carry the same thinking and answer; a budget ends the thinking and an answer follows; max_tokens
inside the thinking is a length finish with the thinking and an empty answer; thinking off gives
none; and a model without a reasoning format (the default server) answers 400 in each API's
shape when asked to think. Token counts are tiny: each generated token costs."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest

QUESTION = "What is 2+2?"
MESSAGES = [{"role": "user", "content": QUESTION}]
BUDGET = 4  # thinking tokens before the sampler closes the thinking
MAX_TOKENS = 12  # room for the thinking, its close and a few answer tokens
CUT = 5  # max_tokens that end inside the thinking
SEEDED = {"seed": 7, "temperature": 0.7}


@pytest.fixture(scope="module")
def thinking_openai(thinking_server):
    return thinking_server.openai()


@pytest.fixture(scope="module")
def thinking_model(thinking_openai) -> str:
    return thinking_openai.models.list().data[0].id


# ---- OpenAI chat completions ---------------------------------------------------------------------

def test_openai_chat_budget_ends_the_thinking_and_streamed_equals_whole(thinking_openai, thinking_model):
    request = dict(model=thinking_model, messages=MESSAGES, max_tokens=MAX_TOKENS, **SEEDED,
                   extra_body={"max_thinking_tokens": BUDGET})
    whole = thinking_openai.chat.completions.create(**request)
    message = whole.choices[0].message
    assert message.reasoning_content and message.reasoning == message.reasoning_content and message.content
    assert 0 < whole.usage.completion_tokens_details.reasoning_tokens <= BUDGET
    chunks = list(thinking_openai.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                          **request))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(delta, "reasoning_content", None) or "" for delta in deltas) == message.reasoning_content
    assert "".join(delta.content or "" for delta in deltas) == message.content
    # The same counts; the second request found the first one's prompt in the prefix cache.
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == whole.usage.model_dump(
        exclude={"prompt_tokens_details"})
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.usage.prompt_tokens - 1


def test_openai_chat_length_inside_the_thinking_and_thinking_off(thinking_openai, thinking_model):
    cut = thinking_openai.chat.completions.create(model=thinking_model, messages=MESSAGES, max_tokens=CUT, **SEEDED)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.reasoning_content and cut.choices[0].message.content == ""
    off = thinking_openai.chat.completions.create(model=thinking_model, messages=MESSAGES, max_tokens=CUT,
                                                  reasoning_effort="none", **SEEDED)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


# ---- OpenAI Responses ----------------------------------------------------------------------------

def test_responses_reasoning_item_before_the_message_and_its_events(thinking_openai, thinking_model):
    request = dict(model=thinking_model, input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0.7,
                   extra_body={"max_thinking_tokens": BUDGET, "seed": SEEDED["seed"]})
    whole = thinking_openai.responses.create(**request)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.summary == [] and reasoning.content[0].type == "reasoning_text"
    assert reasoning.content[0].text and whole.output_text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= BUDGET
    with thinking_openai.responses.stream(**request) as stream:
        events = list(stream)
    final = events[-1].response  # response.incomplete: max_output_tokens cut the answer
    kinds = [event.type for event in events]
    first_text = kinds.index("response.output_text.delta")
    assert [kind for index, kind in enumerate(kinds[:first_text])
            if kind != "response.reasoning_text.delta" or kinds[index - 1] != kind] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added"]
    streamed = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert streamed == final.output[0].content[0].text == reasoning.content[0].text
    assert final.output_text == whole.output_text and final.usage == whole.usage


def test_responses_length_inside_the_thinking_and_thinking_off(thinking_openai, thinking_model):
    cut = thinking_openai.responses.create(model=thinking_model, input=QUESTION, max_output_tokens=CUT,
                                           temperature=0.7, extra_body={"seed": SEEDED["seed"]})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output[0].type == "reasoning" and cut.output[0].status == "incomplete"
    assert cut.output[0].content[0].text and cut.output_text == ""
    off = thinking_openai.responses.create(model=thinking_model, input=QUESTION, max_output_tokens=CUT,
                                           reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_langchain_responses_path_shows_the_reasoning(thinking_server, thinking_model):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=thinking_model, base_url=f"{thinking_server.base_url}/v1", api_key="unused",
                     use_responses_api=True, reasoning={"effort": "low"}, max_tokens=CUT, temperature=0,
                     max_retries=0)
    message = llm.invoke(QUESTION)
    blocks = [block for block in message.content if block["type"] == "reasoning"]
    assert blocks and blocks[0]["content"][0]["text"]
    assert message.usage_metadata["output_token_details"]["reasoning"] > 0


# ---- Anthropic Messages --------------------------------------------------------------------------

def test_anthropic_thinking_blocks_budget_and_stream(thinking_server, thinking_model):
    client = anthropic.Anthropic(base_url=thinking_server.base_url, api_key="unused", max_retries=0, timeout=120)
    request = dict(model=thinking_model, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
                   thinking={"type": "enabled", "budget_tokens": BUDGET})
    whole = client.messages.create(**request)
    assert [block.type for block in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking and whole.content[0].signature == "" and whole.content[1].text
    assert 0 < whole.usage.output_tokens_details.thinking_tokens <= BUDGET
    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    raw = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in events
           if event.type in ("content_block_start", "content_block_delta", "content_block_stop")]
    thinking_events = raw[:raw.index(("content_block_stop", None)) + 1]
    assert thinking_events[0] == ("content_block_start", None) and thinking_events[-2:] == [
        ("content_block_delta", "signature_delta"), ("content_block_stop", None)]
    assert {kind for kind in thinking_events[1:-2]} == {("content_block_delta", "thinking_delta")}
    assert [(block.type, getattr(block, "thinking", None), getattr(block, "text", None)) for block in final.content] \
        == [(block.type, getattr(block, "thinking", None), getattr(block, "text", None)) for block in whole.content]
    cut = client.messages.create(model=thinking_model, messages=MESSAGES, max_tokens=CUT,
                                 thinking={"type": "adaptive"}, extra_body={"temperature": 0})
    assert cut.stop_reason == "max_tokens" and [block.type for block in cut.content] == ["thinking"]
    off = client.messages.create(model=thinking_model, messages=MESSAGES, max_tokens=CUT,
                                 thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert "thinking" not in [block.type for block in off.content]


# ---- Ollama -------------------------------------------------------------------------------------

def test_ollama_think_length_stream_and_off(thinking_server, thinking_model):
    client = ollama.Client(host=thinking_server.base_url, timeout=120)
    assert "thinking" in client.show(thinking_model).capabilities
    options = {"num_predict": CUT, "seed": SEEDED["seed"], "temperature": SEEDED["temperature"]}
    whole = client.chat(model=thinking_model, messages=MESSAGES, think=True, options=options)
    assert whole.done_reason == "length" and whole.message.thinking and whole.message.content == ""
    lines = list(client.chat(model=thinking_model, messages=MESSAGES, think=True, options=options, stream=True))
    assert "".join(line.message.thinking or "" for line in lines) == whole.message.thinking
    assert lines[-1].done_reason == "length" and lines[-1].eval_count == whole.eval_count == CUT
    generated = client.generate(model=thinking_model, prompt=QUESTION, think=True, options=options)
    assert generated.thinking == whole.message.thinking and generated.response == ""
    off = client.chat(model=thinking_model, messages=MESSAGES, think=False, options=options)
    assert off.message.thinking is None


# ---- a model without a reasoning format ---------------------------------------------------------

def test_a_model_that_cannot_think_answers_400_in_each_apis_shape(tokios_server, client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, reasoning_effort="low")
    assert error.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input=QUESTION, max_output_tokens=2, reasoning={"effort": "low"})
    assert error.value.body["param"] == "reasoning.effort"
    response = httpx.post(f"{tokios_server.base_url}/v1/messages", timeout=30, json={
        "model": model, "messages": MESSAGES, "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": 4}})
    assert response.status_code == 400 and response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert "no reasoning format" in response.json()["error"]["message"]
    plain_ollama = ollama.Client(host=tokios_server.base_url)
    with pytest.raises(ollama.ResponseError) as error:
        plain_ollama.chat(model=model, messages=MESSAGES, think=True)
    assert error.value.status_code == 400 and "think" in error.value.error
    assert "thinking" not in plain_ollama.show(model).capabilities


def test_a_response_format_shapes_the_answer_after_the_thinking(thinking_openai, thinking_model):
    # QwQ's template opens the thinking in the prompt: the schema applies from the answer's first
    # token, so the thinking is free text and the content is the schema's JSON.
    import json

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    whole = thinking_openai.chat.completions.create(
        model=thinking_model, messages=[{"role": "user", "content": "What is 2 + 2? Answer in JSON."}],
        max_tokens=40, temperature=0, extra_body={"max_thinking_tokens": BUDGET},
        response_format={"type": "json_schema", "json_schema": {"name": "sum", "schema": schema}})
    message = whole.choices[0].message
    assert message.reasoning_content and whole.choices[0].finish_reason == "stop"
    assert set(json.loads(message.content)) == {"answer"}
