"""The Ollama, Anthropic Messages and OpenAI Responses APIs, driven by their official clients
(`ollama`, `anthropic`, `openai`) against the shared default server: whole and streamed answers,
tool round trips, structured output, the model listing routes, errors in each API's own shape,
the same greedy text through all four chat APIs, and the prompt tokens each reports read from the
prefix cache."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from conftest import SMALL_SERVER_FLAG_KEY

PROMPT = "Name three colours of the rainbow."
MESSAGES = [{"role": "user", "content": PROMPT}]
NUM_TOKENS = 24
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                  "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def ollama_client(tokios_server):
    return ollama.Client(host=tokios_server.base_url, timeout=120)


@pytest.fixture(scope="module")
def anthropic_client(tokios_server):
    return anthropic.Anthropic(base_url=tokios_server.base_url, api_key="unused", max_retries=0, timeout=120)


GREEDY = {"temperature": 0}


# ---- one text through four APIs ------------------------------------------------------------------

def test_greedy_text_is_identical_across_the_four_chat_apis(client, model, ollama_client, anthropic_client):
    openai_text = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS,
                                                 temperature=0).choices[0].message.content
    ollama_text = ollama_client.chat(model=model, messages=MESSAGES,
                                     options={"temperature": 0, "num_predict": NUM_TOKENS}).message.content
    anthropic_text = anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS,
                                                      extra_body=GREEDY).content[0].text
    responses_text = client.responses.create(model=model, input=PROMPT, max_output_tokens=NUM_TOKENS,
                                             temperature=0).output_text
    assert openai_text and openai_text == ollama_text == anthropic_text == responses_text


# ---- one set of sampling defaults behind every door -----------------------------------------------

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _logged_sampling(server, num_lines_before: int, timeout_s: float = 10.0) -> dict[str, float]:
    """The sampling values of the one request logged (tokios.requests) after the first
    `num_lines_before` request lines."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in server.log_text().splitlines() if " params={" in line]
        if len(lines) > num_lines_before or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(lines) == num_lines_before + 1, lines[num_lines_before:]
    params = lines[-1].split(" params=", 1)[1]
    return {name: float(match.group(1)) for name in SAMPLING_FIELDS
            for match in [re.search(rf"'{name}': ([-0-9.e]+)", params)] if match}


def test_a_request_that_sets_no_sampling_gets_the_cards_defaults_through_every_api(
        tokios_server, client, model, ollama_client, anthropic_client):
    """The model card's sampling_defaults are what a request leaving them unset gets, through
    the OpenAI chat and completions, Responses, Anthropic and Ollama routes alike; a field the
    request sets is its own. `tokios generate`/`chat` and the web page read the same set
    (tests/unit/test_sampling_defaults.py, test_server_web.py)."""
    card = client.models.retrieve(model).model_extra["sampling_defaults"]
    expected = {name: float(card[name]) for name in SAMPLING_FIELDS}
    assert set(card["source"]) == set(SAMPLING_FIELDS)
    assert expected["temperature"] != 1.0  # not OpenAI's: a small model rambles at 1.0 with nothing cut
    calls = {
        "openai chat": lambda: client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2),
        "openai completions": lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=2),
        "responses": lambda: client.responses.create(model=model, input=PROMPT, max_output_tokens=2),
        "anthropic": lambda: anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=2),
        "ollama chat": lambda: ollama_client.chat(model=model, messages=MESSAGES, options={"num_predict": 2}),
        "ollama generate": lambda: ollama_client.generate(model=model, prompt=PROMPT, options={"num_predict": 2}),
    }
    for door, call in calls.items():
        num_lines = sum(" params={" in line for line in tokios_server.log_text().splitlines())
        answer = call()
        assert _logged_sampling(tokios_server, num_lines) == pytest.approx(expected), door
        if door == "responses":
            assert answer.temperature == pytest.approx(expected["temperature"])
            assert answer.top_p == pytest.approx(expected["top_p"])
    num_lines = sum(" params={" in line for line in tokios_server.log_text().splitlines())
    ollama_client.chat(model=model, messages=MESSAGES, options={"num_predict": 2, "top_k": 3, "temperature": 0.5})
    assert _logged_sampling(tokios_server, num_lines) == pytest.approx({**expected, "top_k": 3, "temperature": 0.5})
    shown = ollama_client.show(model).parameters.splitlines()
    assert f"top_k {card['top_k']}" in shown and "repeat_penalty 1" in shown


def test_models_retrieve_answers_one_card_and_an_unknown_id_is_a_404(client, model):
    retrieved = client.models.retrieve(model)
    listed = {card.id: card for card in client.models.list().data}
    assert retrieved.id == model and retrieved.model_dump() == listed[model].model_dump()
    assert retrieved.model_extra["kind"] == "generate"
    assert client.models.retrieve(f"{model}:latest").id == model  # Ollama's spelling, as every route takes it
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("no-such-model")
    assert error.value.status_code == 404 and "no-such-model" in str(error.value) and model in str(error.value)
    assert error.value.body["code"] == "model_not_found"


# ---- cached prompt tokens, in each API's own words -----------------------------------------------

CACHE_SYSTEM = ("You are the archivist of a small maritime museum. Answer questions about ship models, "
                "logbooks and charts in the collection; say when something is not in the catalogue.")
CACHE_QUESTION = "Which logbooks from the 1850s do you hold?"


def test_each_api_reports_the_prompt_tokens_the_prefix_cache_served(client, model, ollama_client,
                                                                     anthropic_client, tokios_server):
    messages = [{"role": "system", "content": CACHE_SYSTEM}, {"role": "user", "content": CACHE_QUESTION}]
    cold = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    num_prompt = cold.usage.prompt_tokens
    # At most the template's opening, which every chat request of this server shares.
    assert cold.usage.prompt_tokens_details.cached_tokens < 16
    # Every later request finds all of it but the last prompt token (whose logits it needs): the
    # full blocks, and the tokens of the cold request's last block, never filled.
    num_cached = num_prompt - 1
    assert num_cached >= 32
    warm = client.chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert (warm.usage.prompt_tokens, warm.usage.prompt_tokens_details.cached_tokens) == (num_prompt, num_cached)
    streamed = list(client.chat.completions.create(model=model, messages=messages, max_tokens=1, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == num_cached
    with tokios_server.client() as http:
        prompt_ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert len(prompt_ids) == num_prompt
    completion = client.completions.create(model=model, prompt=prompt_ids, max_tokens=1)
    assert completion.usage.prompt_tokens_details.cached_tokens == num_cached

    response = client.responses.create(model=model, instructions=CACHE_SYSTEM, input=CACHE_QUESTION,
                                       max_output_tokens=1)
    assert (response.usage.input_tokens, response.usage.input_tokens_details.cached_tokens) == (num_prompt,
                                                                                                  num_cached)
    # Anthropic counts the cache read apart from input_tokens, in message_start and at the end.
    anthropic_messages = [{"role": "user", "content": CACHE_QUESTION}]
    message = anthropic_client.messages.create(model=model, system=CACHE_SYSTEM, messages=anthropic_messages,
                                               max_tokens=1)
    with anthropic_client.messages.stream(model=model, system=CACHE_SYSTEM, messages=anthropic_messages,
                                          max_tokens=1) as stream:
        started = next(event for event in stream if event.type == "message_start")
        final = stream.get_final_message()
    for usage in (message.usage, started.message.usage, final.usage):
        assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (
            num_prompt - num_cached, num_cached, 0)
    # Ollama counts only the prompt tokens it evaluated.
    answer = ollama_client.chat(model=model, messages=messages, options={"num_predict": 1})
    assert answer.prompt_eval_count == num_prompt - num_cached


# ---- Ollama -------------------------------------------------------------------------------------

def test_ollama_chat_whole_and_streamed_agree_and_report_counts_and_durations(ollama_client, model):
    options = {"temperature": 0, "num_predict": NUM_TOKENS}
    whole = ollama_client.chat(model=model, messages=MESSAGES, options=options)
    chunks = list(ollama_client.chat(model=model, messages=MESSAGES, options=options, stream=True))
    assert "".join(chunk.message.content for chunk in chunks) == whole.message.content
    assert [chunk.done for chunk in chunks].count(True) == 1 and chunks[-1].done
    for final in (whole, chunks[-1]):
        # prompt_eval_count leaves out what the prefix cache held (earlier tests sent this prompt).
        assert final.done_reason == "length" and final.eval_count == NUM_TOKENS and final.prompt_eval_count >= 1
        assert final.prompt_eval_duration > 0 and final.eval_duration > 0
        assert final.total_duration >= final.prompt_eval_duration + final.eval_duration


def test_ollama_generate_uses_the_template_unless_raw(ollama_client, model, client):
    options = {"temperature": 0, "num_predict": NUM_TOKENS}
    templated = ollama_client.generate(model=model, prompt=PROMPT, options=options)
    chat_text = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS,
                                               temperature=0).choices[0].message.content
    assert templated.response == chat_text
    raw = ollama_client.generate(model=model, prompt="The capital of France is", raw=True, options=options)
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=NUM_TOKENS,
                                           temperature=0).choices[0].text
    assert raw.response == completion
    streamed = "".join(chunk.response for chunk in ollama_client.generate(
        model=model, prompt="The capital of France is", raw=True, options=options, stream=True))
    assert streamed == completion


def test_ollama_options_stop_seed_and_format(ollama_client, model):
    text = ollama_client.generate(model=model, prompt=PROMPT, options={"temperature": 0, "num_predict": 40}).response
    stop_word = text.split()[2]
    stopped = ollama_client.generate(model=model, prompt=PROMPT,
                                     options={"temperature": 0, "num_predict": 40, "stop": [stop_word]})
    assert stop_word not in stopped.response and text.startswith(stopped.response) and stopped.done_reason == "stop"
    seeded = [ollama_client.generate(model=model, prompt=PROMPT, options={"temperature": 1.0, "seed": 7,
                                                                          "num_predict": 16}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    person = ollama_client.chat(model=model, format=PERSON_SCHEMA, options={"temperature": 0, "num_predict": 64},
                                messages=[{"role": "user", "content": "Describe a person as JSON."}])
    jsonschema.validate(json.loads(person.message.content), PERSON_SCHEMA)
    # A reply the prompt spells out: free-form JSON has no bound, and a 135M model's greedy
    # object of its own invention can nest until num_predict.
    as_json = ollama_client.generate(model=model, prompt='Reply with the JSON object {"ok": true}.', format="json",
                                     options={"temperature": 0, "num_predict": 200})
    assert as_json.done_reason == "stop" and isinstance(json.loads(as_json.response), dict)


def test_ollama_format_objects_admit_only_their_properties(ollama_client, model):
    """A `format` schema that lists properties and says nothing of others is closed, as tool
    parameters are and as Ollama's own grammar closes it: SmolLM2 asked for a person's name, age
    and city under a schema listing only `name` wrote `{"name": "John Smith", "age": 45, "city":
    "New York"}` while schemas were left open."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}}, "required": ["name"]}
    person = ollama_client.chat(model=model, format=schema, options={"temperature": 0, "num_predict": 80},
                                messages=[{"role": "user", "content": "Describe a person as JSON with their name, "
                                                                      "age and city."}])
    assert person.done_reason == "stop" and list(json.loads(person.message.content)) == ["name"]


def test_ollama_refuses_options_it_cannot_honour(ollama_client, model):
    for options, named in (({"mirostat": 2}, "options.mirostat"), ({"num_ctx": 10**6}, "options.num_ctx"),
                           ({"num_gpu": 1}, "options.num_gpu"), ({"typical_p": 0.5}, "options.typical_p"),
                           ({"temperature": "hot"}, "options.temperature"), ({"bogus": 1}, "options.bogus")):
        with pytest.raises(ollama.ResponseError) as error:
            ollama_client.generate(model=model, prompt=PROMPT, options=options)
        assert error.value.status_code == 400 and named in error.value.error, options
    with pytest.raises(ollama.ResponseError) as error:
        ollama_client.chat(model="no-such-model", messages=MESSAGES)
    assert error.value.status_code == 404 and "no-such-model" in error.value.error


def test_ollama_num_ctx_caps_prompt_and_output(ollama_client, model):
    capped = ollama_client.generate(model=model, prompt=PROMPT, options={"temperature": 0, "num_ctx": 40})
    assert capped.prompt_eval_count + capped.eval_count <= 40 and capped.done_reason == "length"


def test_ollama_listing_routes(ollama_client, model, tokios_server):
    assert model in [entry.model for entry in ollama_client.list().models]
    shown = ollama_client.show(model)
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert shown.details.family == "llama" and shown.details.quantization_level == "Q4_1"
    assert shown.details.parameter_size.endswith("M")
    assert shown.modelinfo["general.architecture"] == "llama" and "messages" in shown.template
    running = ollama_client.ps().models
    assert [entry.model for entry in running] == [model] and running[0].context_length > 0
    assert httpx.get(f"{tokios_server.base_url}/api/version").json()["version"]


def test_ollama_ps_shows_a_keep_alive_of_centuries_as_far_future(ollama_client, model, tokios_server):
    # Found by the fuzzer once requests could name the served model: a finite keep_alive past the
    # year 9999 made /api/ps a 500. Afterwards the model is kept loaded, as a single model is by default.
    assert httpx.post(f"{tokios_server.base_url}/api/generate",
                      json={"model": model, "keep_alive": 1e300}, timeout=60).status_code == 200
    try:
        (running,) = ollama_client.ps().models
        assert running.expires_at.year == 2100
    finally:
        httpx.post(f"{tokios_server.base_url}/api/generate", json={"model": model, "keep_alive": -1}, timeout=60)


def test_ollama_logprobs(ollama_client, model):
    answer = ollama_client.generate(model=model, prompt=PROMPT, logprobs=True, top_logprobs=2,
                                    options={"temperature": 0, "num_predict": 5})
    assert len(answer.logprobs) == 5 and "".join(entry.token for entry in answer.logprobs) == answer.response
    assert all(len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
               for entry in answer.logprobs)


def test_ollama_tool_history_is_accepted(ollama_client, model):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": WEATHER_SCHEMA}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}]
    answer = ollama_client.chat(model=model, messages=messages, tools=tools,
                                options={"temperature": 0, "num_predict": 24})
    assert answer.message.content or answer.message.tool_calls


# ---- Anthropic ----------------------------------------------------------------------------------

def test_anthropic_create_and_stream_agree(anthropic_client, model):
    created = anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS,
                                               extra_body=GREEDY)
    assert created.stop_reason == "max_tokens" and created.usage.output_tokens == NUM_TOKENS
    with anthropic_client.messages.stream(model=model, messages=MESSAGES, max_tokens=NUM_TOKENS,
                                          extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == created.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == NUM_TOKENS
    counted = anthropic_client.messages.count_tokens(model=model, messages=MESSAGES)
    assert counted.input_tokens == created.usage.input_tokens + created.usage.cache_read_input_tokens


def test_anthropic_event_sequence(tokios_server, model):
    body = {"model": model, "max_tokens": 8, "messages": MESSAGES, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{tokios_server.base_url}/v1/messages", json=body, timeout=60) as response:
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start" and events[1] == "content_block_start"
    assert set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequences_and_system(anthropic_client, model, tokios_server):
    text = anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=40,
                                            extra_body=GREEDY).content[0].text
    stop_word = text.split()[2]
    stopped = anthropic_client.messages.create(model=model, messages=MESSAGES, max_tokens=40,
                                               stop_sequences=[stop_word], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop_word
    assert stop_word not in stopped.content[0].text
    with_system = anthropic_client.messages.count_tokens(model=model, messages=MESSAGES, system="Be brief.")
    with tokios_server.client() as http:
        openai_count = http.post("/tokenize", json={"messages": [{"role": "system", "content": "Be brief."},
                                                                 *MESSAGES]}).json()["count"]
    assert with_system.input_tokens == openai_count


def test_anthropic_tool_round_trip(anthropic_client, model):
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}]
    question = {"role": "user", "content": "What is the weather in Paris?"}
    called = anthropic_client.messages.create(model=model, max_tokens=64, tools=tools, messages=[question],
                                              tool_choice={"type": "tool", "name": "get_weather",
                                                           "disable_parallel_tool_use": True}, extra_body=GREEDY)
    uses = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    with anthropic_client.messages.stream(model=model, max_tokens=64, tools=tools, messages=[question],
                                          tool_choice={"type": "tool", "name": "get_weather",
                                                       "disable_parallel_tool_use": True},
                                          extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert [block.input for block in streamed.content if block.type == "tool_use"] == [uses[0].input]
    answer = anthropic_client.messages.create(model=model, max_tokens=32, tools=tools, extra_body=GREEDY, messages=[
        question, {"role": "assistant", "content": called.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "18 degrees and sunny"}]}])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_anthropic_tool_choice_any_none_and_one_call_only(anthropic_client, model):
    """`any` with disable_parallel_tool_use: exactly one tool_use and the turn ends (tool_use),
    whole and streamed, where with parallel calls allowed SmolLM2's greedy answer repeats the
    same call until max_tokens (measured: six identical calls in 200 tokens); `none`: no call."""
    tools = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}]
    kwargs = dict(model=model, max_tokens=200, tools=tools, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    one = {"type": "any", "disable_parallel_tool_use": True}
    called = anthropic_client.messages.create(tool_choice=one, **kwargs)
    uses = [block for block in called.content if block.type == "tool_use"]
    assert called.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    with anthropic_client.messages.stream(tool_choice=one, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(block.name, block.input) for block in streamed.content if block.type == "tool_use"] == [
        (uses[0].name, uses[0].input)]
    none = anthropic_client.messages.create(tool_choice={"type": "none"}, **{**kwargs, "max_tokens": 24})
    assert none.stop_reason != "tool_use" and [block.type for block in none.content] == ["text"]
    assert "<tool_call>" not in none.content[0].text


def test_anthropic_structured_output(anthropic_client, model):
    answer = anthropic_client.messages.create(
        model=model, max_tokens=64, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON_SCHEMA}}, extra_body=GREEDY)
    jsonschema.validate(json.loads(answer.content[0].text), PERSON_SCHEMA)


def test_anthropic_errors_in_its_own_shape(anthropic_client, model, tokios_server):
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.create(model="no-such-model", messages=MESSAGES, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError) as error:
        anthropic_client.messages.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert "messages.0.content.0" in error.value.message
    response = httpx.post(f"{tokios_server.base_url}/v1/messages", json={"model": model, "messages": MESSAGES},
                          timeout=30)
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "max_tokens is required"}}


def test_anthropic_key_in_x_api_key(small_keyed_server):
    model = httpx.get(f"{small_keyed_server.base_url}/v1/models", headers=small_keyed_server.headers).json()[
        "data"][0]["id"]
    keyed = anthropic.Anthropic(base_url=small_keyed_server.base_url, api_key=SMALL_SERVER_FLAG_KEY, max_retries=0)
    assert keyed.messages.create(model=model, messages=MESSAGES, max_tokens=2).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as error:
        anthropic.Anthropic(base_url=small_keyed_server.base_url, api_key="sk-wrong", max_retries=0).messages.create(
            model=model, messages=MESSAGES, max_tokens=2)
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "authentication_error"


# ---- OpenAI Responses ---------------------------------------------------------------------------

def test_responses_create_stream_and_retrieve(client, model):
    created = client.responses.create(model=model, input=PROMPT, max_output_tokens=NUM_TOKENS, temperature=0)
    assert created.status == "incomplete" and created.incomplete_details.reason == "max_output_tokens"
    assert created.usage.output_tokens == NUM_TOKENS
    with client.responses.stream(model=model, input=PROMPT, max_output_tokens=400, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text and final.output_text.startswith(created.output_text)
    assert client.responses.retrieve(created.id).output_text == created.output_text


def test_responses_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, input="My name is Ada.", instructions="Be brief.",
                                    max_output_tokens=16, temperature=0)
    follow_up = client.responses.create(model=model, input="What is my name?", previous_response_id=first.id,
                                        max_output_tokens=16, temperature=0)
    alone = client.responses.create(model=model, input="What is my name?", max_output_tokens=16, temperature=0)
    # The follow-up's prompt holds the first turn and its answer (but not the old instructions).
    assert follow_up.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="hi", previous_response_id="resp_missing", max_output_tokens=2)
    unstored = client.responses.create(model=model, input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_responses_function_call_round_trip(client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
              "parameters": WEATHER_SCHEMA}]
    called = client.responses.create(model=model, input="What is the weather in Paris?", tools=tools,
                                     tool_choice="required", max_output_tokens=64, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    with client.responses.stream(model=model, input="What is the weather in Paris?", tools=tools,
                                 tool_choice="required", max_output_tokens=64, temperature=0) as stream:
        final = stream.get_final_response()
    assert [item.arguments for item in final.output if item.type == "function_call"] == [calls[0].arguments]
    answer = client.responses.create(model=model, previous_response_id=called.id, tools=tools, temperature=0,
                                     max_output_tokens=24, input=[{"type": "function_call_output",
                                                                   "call_id": calls[0].call_id,
                                                                   "output": "18 degrees and sunny"}])
    assert answer.output_text or any(item.type == "function_call" for item in answer.output)


def test_responses_text_format_json_schema(client, model):
    answer = client.responses.create(model=model, input="Describe a person as JSON.", max_output_tokens=64,
                                     temperature=0, text={"format": {"type": "json_schema", "name": "person",
                                                                     "schema": PERSON_SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(answer.output_text), PERSON_SCHEMA)


def test_responses_refuse_what_they_cannot_do(client, model):
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}], max_output_tokens=2)
    assert "input[0].content" in str(error.value)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=model, input="hi", tools=[{"type": "web_search"}], max_output_tokens=2)
    assert "tools[0].type" in str(error.value)


# ---- what lm-evaluation-harness's remote tokenizer asks ------------------------------------------

def test_tokenizer_info_and_tokenize_serve_a_remote_tokenizer(tokios_server, model):
    """lm-eval's `tokenizer_backend=remote`: GET /tokenizer_info, then the special tokens' ids and
    every encoding through /tokenize (add_special_tokens false) and decoding through /detokenize."""
    with tokios_server.client() as http:
        info = http.get("/tokenizer_info").json()
        assert info["model"] == model and info["eos_token"] == "<|im_end|>" and info["model_max_length"] > 0
        assert "messages" in info["chat_template"]
        eos_ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
        assert eos_ids["tokens"] == [info["eos_token_id"]]
        text = "The quick brown fox"
        ids = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == text
        assert http.get("/tokenizer_info", params={"model": "no-such-model"}).status_code == 404


# ---- embeddings (OpenAI and Ollama) -------------------------------------------------------------

def test_embeddings_through_openai_and_ollama_agree_and_are_normalized(client, model, ollama_client, tokios_server):
    import math

    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today."]
    openai_vectors = [item.embedding for item in client.embeddings.create(model=model, input=texts).data]  # base64
    with tokios_server.client() as http:
        floats = http.post("/v1/embeddings", json={"model": model, "input": texts, "encoding_format": "float"}).json()
        by_ids = http.post("/v1/embeddings", json={"model": model, "input": [
            http.post("/tokenize", json={"prompt": texts[0]}).json()["tokens"]]}).json()
        too_narrow = http.post("/v1/embeddings", json={"model": model, "input": "x", "dimensions": 8})
    ollama_vectors = ollama_client.embed(model=model, input=texts).embeddings
    assert floats["usage"]["prompt_tokens"] > 0 and len(openai_vectors) == len(ollama_vectors) == 3

    def cosine(a, b):
        return sum(x * y for x, y in zip(a, b)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    for a, b, c in zip(openai_vectors, ollama_vectors, [item["embedding"] for item in floats["data"]]):
        assert len(a) == len(b) == 576 and abs(math.sqrt(sum(x * x for x in a)) - 1) < 1e-4
        assert cosine(a, b) > 0.9999 and cosine(a, c) > 0.9999
    assert cosine(by_ids["data"][0]["embedding"], openai_vectors[0]) > 0.9999
    # Pooled states of a generative model: similar sentences still land closer than unrelated ones.
    assert cosine(openai_vectors[0], openai_vectors[1]) > cosine(openai_vectors[0], openai_vectors[2])
    assert too_narrow.status_code == 400 and too_narrow.json()["error"]["param"] == "dimensions"
    legacy = httpx.post(f"{tokios_server.base_url}/api/embeddings", json={"model": model, "prompt": texts[0]},
                        timeout=60).json()["embedding"]
    assert cosine(legacy, openai_vectors[0]) > 0.9999
