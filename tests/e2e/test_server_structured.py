"""Structured output and tool calls through a real server, with the official openai SDK and
LangChain: JSON schemas (pydantic and generated), regex / choice / Lark on completions, every
tool_choice, streamed tool-call deltas, parallel calls, a tool-result history, bad input, metrics."""

from __future__ import annotations

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import jsonschema
import pydantic
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from structured_schemas import schemas  # noqa: E402

WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}}},
]
PARAMETERS_BY_NAME = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def assert_valid_calls(tool_calls, complete: bool = True):
    assert tool_calls
    for call in tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        parameters = PARAMETERS_BY_NAME[call.function.name]
        if complete:
            jsonschema.validate(json.loads(call.function.arguments), parameters)


# ---- JSON ---------------------------------------------------------------------------------

# Every string bounded, so any reply the schema allows ends within max_tokens: a 135M model's
# greedy reply can run on inside an unbounded string (a change in the attention's rounding once
# turned "Eiffel Tower" into "Bien-Souvent-Bien-Souvent-..." up to the limit), and this test is
# about the SDK's parse, not about the model's taste.
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float = pydantic.Field(ge=0, le=100)
    landmarks: list[Annotated[str, pydantic.Field(max_length=40)]] = pydantic.Field(max_length=3)


def test_sdk_parse_with_a_pydantic_model(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe Paris as a record."}], response_format=City,
        max_tokens=400, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)
    json_mode = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
        response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    assert json_mode.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(json_mode.choices[0].message.content), dict)


def _ask(client, model, schema, temperature: float, stream: bool) -> tuple[str, str]:
    kwargs = dict(model=model, messages=[{"role": "user", "content": f"JSON for: {json.dumps(schema)}"}],
                  max_tokens=400, temperature=temperature, seed=7,
                  response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish_reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return text, finish_reason


def test_generated_schemas_validate_streamed_and_not(client, model):
    answers: list[str] = []

    @settings(max_examples=2, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(schemas, min_size=4, max_size=4))
    def check(drawn_schemas):
        jobs = [(schema, temperature, stream) for schema in drawn_schemas for temperature in (0.0, 1.0)
                for stream in (False, True)]
        with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent requests: one batch in the engine
            results = list(pool.map(lambda job: _ask(client, model, *job), jobs))
        for (schema, temperature, stream), (text, finish_reason) in zip(jobs, results):
            assert finish_reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
            answers.append(text)
        # Streamed and non-streamed greedy answers are not compared for equality: sent together,
        # one request's prompt may hit the prefix cache the other filled, which lays the prefill
        # out differently and may flip a near-tie (docs/architecture.md; a full run saw it).

    check()
    assert len(set(answers)) > 4


# ---- completions: regex, choice, grammar ----------------------------------------------------

def test_completions_with_regex_choice_and_lark(tokios_server, model):
    cases = [
        ({"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}, "Today's date is", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        ({"choice": ["positive", "negative"]}, "Review: I loved it. Sentiment:", r"positive|negative"),
        ({"grammar": 'start: "Answer: " ANSWER\nANSWER: "yes" | "no"'}, "Is the sky blue?", r"Answer: (yes|no)"),
    ]
    with tokios_server.client() as http:
        for structured, prompt, pattern in cases:
            for stream in (False, True):
                body = {"model": model, "prompt": prompt, "max_tokens": 30, "temperature": 1.0, "seed": 1,
                        "structured_outputs": structured, "stream": stream}
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                if stream:
                    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
                              if line.startswith("data: {")]
                    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
                else:
                    text = response.json()["choices"][0]["text"]
                assert re.fullmatch(pattern, text), (structured, text)


# ---- tools -----------------------------------------------------------------------------------

def test_each_tool_choice(client, model):
    def ask(tool_choice, **extra):
        return client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                              max_tokens=120, temperature=0, **extra).choices[0]

    required = ask("required")
    assert required.finish_reason == "tool_calls" and required.message.content is None
    assert_valid_calls(required.message.tool_calls)
    named = ask({"type": "function", "function": {"name": "get_time"}})
    assert named.finish_reason == "tool_calls"
    assert [call.function.name for call in named.message.tool_calls] == ["get_time"]
    assert_valid_calls(named.message.tool_calls)
    none = ask("none")
    assert not none.message.tool_calls and none.message.content and "<tool_call>" not in none.message.content
    auto = ask("auto")
    if auto.message.tool_calls:
        assert auto.finish_reason == "tool_calls"
        assert_valid_calls(auto.message.tool_calls)
    assert "<tool_call>" not in (auto.message.content or "")
    # Greedy auto at temperature 1 over seeds: both kinds of answer occur and are well formed.
    kinds = set()
    for seed in range(6):
        choice = client.chat.completions.create(model=model, messages=ASK_WEATHER, tools=TOOLS, max_tokens=80,
                                                temperature=1.0, seed=seed).choices[0]
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            assert_valid_calls(choice.message.tool_calls, complete=choice.finish_reason == "tool_calls")
        kinds.add(bool(choice.message.tool_calls))
    assert kinds, kinds


def _streamed_answer(client, **kwargs):
    """(content, calls by index as {"id", "name", "arguments"}, finish_reason) of a streamed answer;
    each chunk names a call at most once."""
    calls: dict[int, dict] = {}
    content, finish_reason = "", None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish_reason = chunk.choices[0].finish_reason or finish_reason
        indexes = [call.index for call in delta.tool_calls or ()]
        assert len(indexes) == len(set(indexes)), delta
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            if call.id:
                assert entry["id"] is None and call.function.name and call.type == "function"
                # OpenAI's own stream: the first delta's arguments are "", the JSON follows.
                assert call.function.arguments == "", call
                entry["id"], entry["name"] = call.id, call.function.name
            entry["arguments"] += call.function.arguments or ""
    return content, calls, finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_streamed_tool_calls_equal_non_streamed_over_seeds(client, model):
    """20 seeds at temperature 1, tool_choice auto and required, parallel calls allowed: the
    streamed deltas of every call concatenate to the non-streamed call byte for byte (names and
    arguments; ids are made per response, so two responses' ids differ), the content is the same,
    indexes and ids are distinct, and the finish reason is tool_calls whenever whole calls were
    made. The requests run at once: seeded sampling does not depend on the batch."""
    prompts = {"auto": [{"role": "user", "content": "Call get_weather for Paris."}],
               "required": [{"role": "user", "content": "What is the weather and the time in Paris and in London?"}]}
    requests = [dict(model=model, messages=prompts[tool_choice], tools=TOOLS, tool_choice=tool_choice,
                     parallel_tool_calls=True, max_tokens=60, temperature=1.0, seed=seed)
                for tool_choice in ("auto", "required") for seed in range(20)]
    with ThreadPoolExecutor(len(requests)) as pool:
        wholes = list(pool.map(lambda kwargs: client.chat.completions.create(**kwargs).choices[0], requests))
        streams = list(pool.map(lambda kwargs: _streamed_answer(client, **kwargs), requests))
    num_with_calls = {"auto": 0, "required": 0}
    for kwargs, whole, (content, calls, finish_reason) in zip(requests, wholes, streams):
        where = (kwargs["tool_choice"], kwargs["seed"])
        whole_calls = whole.message.tool_calls or []
        assert sorted(calls) == list(range(len(calls))), where
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in whole_calls], where
        assert content == (whole.message.content or ""), where
        assert finish_reason == whole.finish_reason, where
        assert len({c["id"] for c in calls.values()}) == len(calls) and len({c.id for c in whole_calls}) == len(calls)
        assert "<tool_call>" not in content, where
        if whole_calls:
            num_with_calls[kwargs["tool_choice"]] += 1
            is_complete = _is_json(whole_calls[-1].function.arguments)
            assert whole.finish_reason == ("tool_calls" if is_complete else "length"), where
            complete_calls = whole_calls if is_complete else whole_calls[:-1]
            if complete_calls:
                assert_valid_calls(complete_calls)
    assert num_with_calls["required"] == 20 and num_with_calls["auto"] >= 1, num_with_calls  # measured: auto 2 of 20


def test_parallel_calls_and_a_tool_result_history(client, model):
    messages = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
    choice = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=True, max_tokens=160, temperature=0).choices[0]
    calls = choice.message.tool_calls
    assert len(calls) >= 2 and len({call.id for call in calls}) == len(calls)
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut by length
    assert_valid_calls(complete)
    cities = {json.loads(call.function.arguments)["city"] for call in complete}
    assert {"Paris", "London"} <= cities, cities
    single = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=160, temperature=0).choices[0]
    assert single.finish_reason == "tool_calls" and len(single.message.tool_calls) == 1
    history = messages + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"} for call in calls]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, max_tokens=40,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert "<tool_call>" not in (answer.message.content or "")


def test_langchain_structured_output_and_bound_tools(tokios_server, model):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=f"{tokios_server.base_url}/v1", api_key="unused", model=model, temperature=0,
                      max_tokens=200, max_retries=0)
    city = chat.with_structured_output(City).invoke("Describe Rome as a record.")
    assert isinstance(city, City)

    @tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city, in 'celsius' or 'fahrenheit'."""
        return "18"

    message = chat.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Berlin?")
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}
    assert get_weather.invoke(message.tool_calls[0]["args"]) == "18"


# ---- errors and metrics -----------------------------------------------------------------------

@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}},
     "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters"),
    ("/v1/completions", {"structured_outputs": {"grammar": "start: ( 'unclosed'"}}, "structured_outputs.grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/chat/completions", {"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_grammars_and_tools_are_400s_naming_the_field(tokios_server, model, path, extra, param):
    body = {"model": model, "max_tokens": 5, "stream": True, **extra}
    body.update({"messages": ASK_WEATHER} if path.endswith("chat/completions") else {"prompt": "x"})
    with tokios_server.client() as http:
        response = http.post(path, json=body)
    assert response.status_code == 400, response.text  # before the stream starts, not an SSE error
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_metrics_count_constrained_requests_and_time_compiles_and_masks(tokios_server):
    with tokios_server.client() as http:
        metrics = http.get("/metrics").text
        stats = http.get("/v1/engine/stats").json()
    assert float(re.search(r"^tokios:structured_output_requests_total\{model_name=\"[^\"]+\"\} (\S+)$", metrics, re.M).group(1)) > 0
    assert float(re.search(r"^tokios:grammar_compile_seconds_count\{model_name=\"[^\"]+\"\} (\S+)$", metrics, re.M).group(1)) > 0
    assert float(re.search(r"^tokios:grammar_mask_seconds_count\{model_name=\"[^\"]+\"\} (\S+)$", metrics, re.M).group(1)) > 0
    assert stats["grammar_mask_seconds"]["count"] > 0 and stats["num_constrained_requests"] > 0
