"""tools/bench/serve.py against a real HTTP server that streams like an OpenAI-compatible one.

The server below (FastAPI + uvicorn on a loopback port, in a thread) streams SSE chunks with known
delays and token counts, counts how many requests it has in flight, and fails on demand, so the
load generator's counting, concurrency limits and failure handling are checked exactly.
"""

import asyncio
import json
import math
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokios.cli import main as tokios_main
from tokios.errors import InvalidRequestError
from tokios.tools.bench.prompts import LengthSpec
from tokios.tools.bench.serve import (
    BenchRequest,
    ServeLoad,
    build_requests,
    chunk_text,
    parse_concurrencies,
    parse_sse_data,
    read_tools,
    request_body,
    run_level,
)
from tokios.tools.bench.peers import free_port

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_DELAY_S = 0.005
TOKENS_PER_CHUNK = 2  # usage reports twice the chunk count, so the two counting paths differ


def make_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, endpoint: str):
        state["in_flight"] += 1
        state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
        try:
            prompt = body.get("prompt") or body["messages"][-1]["content"]
            if endpoint == "chat":
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            num_chunks = body["max_tokens"]
            for i in range(num_chunks):
                if "STREAMERR" in prompt and i == 1:
                    yield _sse({"error": {"message": "engine failed", "type": "internal_error"}})
                    break
                piece = "ab"
                choice = {"index": 0, "delta": {"content": piece}} if endpoint == "chat" else {"index": 0, "text": piece}
                yield _sse({"choices": [choice]})
                await asyncio.sleep(TOKEN_DELAY_S)
            if body.get("stream_options", {}).get("include_usage") and body["model"] != "no-usage":
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": TOKENS_PER_CHUNK * num_chunks}
                yield _sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            state["in_flight"] -= 1

    async def handle(request: Request, endpoint: str):
        body = await request.json()
        state["bodies"].append(body)
        prompt = body.get("prompt") or body["messages"][-1]["content"]
        if body["model"] not in ("fake-model", "no-usage"):
            return JSONResponse({"error": {"message": "model not found"}}, status_code=404)
        if "FAIL" in prompt:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        return StreamingResponse(stream(body, endpoint), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    return app


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@pytest.fixture(scope="module")
def fake_server():
    state = {"in_flight": 0, "max_in_flight": 0, "bodies": []}
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the fake server did not start"
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)


def _reset(state):
    # The client can finish reading before the server's generator runs its `finally`, so the last
    # test's streams may still be counted down; resetting under them would leave the count at -1.
    deadline = time.monotonic() + 10
    while state["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state["in_flight"] == 0, "the previous test's streams did not end"
    state.update(max_in_flight=0, bodies=[])


def test_concurrency_limit_usage_counting_and_request_shape(fake_server):
    url, state = fake_server
    _reset(state)
    load = ServeLoad(base_url=url + "/v1", endpoint="chat", num_prompts=8, input_len=LengthSpec(12, 12),
                     output_len=LengthSpec(5, 5))
    requests = build_requests(load)
    summary, records = asyncio.run(run_level(load, requests, label="c=2", max_concurrency=2,
                                             num_warmups=0, show_progress=False))
    assert (summary.num_completed, summary.num_failed) == (8, 0)
    assert state["max_in_flight"] == 2
    assert summary.peak_concurrency == 2
    assert summary.total_output_tokens == 8 * 5 * TOKENS_PER_CHUNK  # from usage, not chunks
    assert summary.total_input_tokens == 8 * 12
    assert all(len(r.chunk_times) == 5 for r in records)  # the role-only chunk is not a token
    assert min(r.ttft_s for r in records) >= FIRST_TOKEN_DELAY_S
    body = state["bodies"][0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 5
    # The prompts all start differently, so no prompt cache can serve a prefill.
    assert len({b["messages"][0]["content"].split()[0:3].__str__() for b in state["bodies"]}) > 4


def test_without_usage_chunks_are_counted_and_completions_endpoint(fake_server):
    url, state = fake_server
    _reset(state)
    load = ServeLoad(base_url=url, endpoint="completions", model="no-usage", num_prompts=3,
                     output_len=LengthSpec(4, 4), ignore_eos=False)
    summary, _ = asyncio.run(run_level(load, build_requests(load), label="c=1", max_concurrency=1,
                                       num_warmups=1, show_progress=False))
    assert summary.num_completed == 3
    assert summary.total_output_tokens == 3 * 4  # one token per content chunk
    assert len(state["bodies"]) == 4  # one warm-up request first
    assert "prompt" in state["bodies"][-1] and "ignore_eos" not in state["bodies"][-1]
    assert state["max_in_flight"] == 1


def test_failures_are_counted_with_their_messages(fake_server):
    url, state = fake_server
    _reset(state)
    load = ServeLoad(base_url=url, num_prompts=3, output_len=LengthSpec(3, 3))
    requests = [BenchRequest("hello there", 3, 2), BenchRequest("FAIL please", 3, 2),
                BenchRequest("STREAMERR now", 3, 2)]
    summary, records = asyncio.run(run_level(load, requests, label="c=3", max_concurrency=3,
                                             num_warmups=0, show_progress=False))
    assert (summary.num_completed, summary.num_failed) == (1, 2)
    assert any(e.startswith("HTTP 500") for e in summary.errors)
    assert any("engine failed" in e for e in summary.errors)
    assert summary.total_output_tokens == 3 * TOKENS_PER_CHUNK


def test_poisson_rate_and_unknown_model_and_unreachable_server(fake_server):
    url, _ = fake_server
    load = ServeLoad(base_url=url, num_prompts=6, output_len=LengthSpec(2, 2))
    summary, _ = asyncio.run(run_level(load, build_requests(load), label="rate", request_rate=200.0,
                                       num_warmups=0, show_progress=False))
    assert summary.num_completed == 6
    wrong_model = ServeLoad(base_url=url, model="other", num_prompts=2, output_len=LengthSpec(2, 2))
    summary, _ = asyncio.run(run_level(wrong_model, build_requests(wrong_model), label="x", num_warmups=0,
                                       show_progress=False))
    assert summary.num_failed == 2 and summary.errors[0].startswith("HTTP 404")
    dead = ServeLoad(base_url=f"http://127.0.0.1:{free_port()}", model="m", num_prompts=1)
    summary, _ = asyncio.run(run_level(dead, build_requests(dead), label="x", num_warmups=0, show_progress=False))
    assert summary.num_failed == 1 and "ConnectError" in summary.errors[0]
    assert math.isnan(summary.ttft.median_ms)


def test_bad_load_parameters_are_named():
    with pytest.raises(InvalidRequestError, match="endpoint"):
        ServeLoad(base_url="http://x", endpoint="embeddings")
    with pytest.raises(InvalidRequestError, match="num_prompts"):
        ServeLoad(base_url="http://x", num_prompts=0)
    with pytest.raises(InvalidRequestError, match="base_url"):
        ServeLoad(base_url="localhost:8000")
    with pytest.raises(InvalidRequestError, match="input_len"):
        LengthSpec.parse("9:3", field_name="input_len")
    with pytest.raises(InvalidRequestError, match="concurrency"):
        parse_concurrencies("1,x")
    assert parse_concurrencies("1, 4,16") == [1, 4, 16] and parse_concurrencies("inf") == [None]
    assert parse_sse_data(": keep-alive") is None and parse_sse_data("data: [DONE]") == "[DONE]"


def test_length_spec_draws_within_range():
    import random

    spec = LengthSpec.parse("3:6", field_name="output_len")
    rng = random.Random(1)
    draws = {spec.draw(rng) for _ in range(200)}
    assert draws == {3, 4, 5, 6}


def test_cli_serve_writes_table_json_and_plots(fake_server, tmp_path, capsys):
    url, _ = fake_server
    json_path = tmp_path / "serve.json"
    code = tokios_main(["bench", "serve", "--base-url", url, "--num-prompts", "4", "--input-len", "8:16",
                        "--output-len", "3", "--concurrency", "1,2", "--json", str(json_path),
                        "--plot-dir", str(tmp_path / "plots"), "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "| metric | c=1 | c=2 |" in out and "TPOT p99 (ms)" in out
    data = json.loads(json_path.read_text())
    assert [level["num_completed"] for level in data["levels"]] == [4, 4]
    assert data["load"]["output_len"] == "3" and "api_key" not in data["load"]
    for name in ("throughput_vs_concurrency.png", "ttft_percentiles.png", "tpot_percentiles.png"):
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_json_schema_load_sends_the_schema_on_each_endpoint_and_quantiles_read_the_difference():
    from tokios.tools.bench.serve import (BUILTIN_JSON_SCHEMA, BenchRequest, ServeLoad, histogram_quantile,
                                          read_json_schema, request_body)

    schema = read_json_schema("builtin")
    assert schema is BUILTIN_JSON_SCHEMA
    request = BenchRequest("hi", 8, 1)
    chat = request_body(ServeLoad("http://x", json_schema=schema), "m", request)
    assert chat["response_format"]["json_schema"]["schema"] == schema
    completions = request_body(ServeLoad("http://x", endpoint="completions", json_schema=schema), "m", request)
    assert completions["structured_outputs"] == {"json": schema}
    assert "response_format" not in request_body(ServeLoad("http://x"), "m", request)
    before = {"buckets": [0.001, 0.01], "counts": [5, 0, 0], "count": 5}
    after = {"buckets": [0.001, 0.01], "counts": [5, 9, 1], "count": 15}
    assert histogram_quantile(before, after, 0.5) == 0.01  # the 10 new ones: 9 in (1, 10] ms
    assert histogram_quantile(before, after, 0.99) == float("inf")
    assert histogram_quantile(after, after, 0.5) is None


def test_each_endpoint_gets_its_own_body_and_stream_parsing():
    from tokios.tools.bench.serve import BenchRequest, ServeLoad, chunk_text, chunk_usage, parse_line, request_body

    request = BenchRequest("hi", 7, 1)
    bodies = {endpoint: request_body(ServeLoad("http://x", endpoint=endpoint), "m", request)
              for endpoint in ("chat", "completions", "responses", "messages", "ollama-chat")}
    assert bodies["responses"]["input"] == "hi" and bodies["responses"]["max_output_tokens"] == 7
    assert bodies["messages"]["messages"][0]["content"] == "hi" and bodies["messages"]["max_tokens"] == 7
    assert bodies["ollama-chat"]["options"] == {"temperature": 0.0, "num_predict": 7, "ignore_eos": True}
    assert all(body["stream"] is True for body in bodies.values())
    usage: dict = {}
    events = [('data: {"type":"response.output_text.delta","delta":"Hel"}', "responses", "Hel", False),
              ('data: {"type":"response.completed","response":{"usage":{"input_tokens":3,"output_tokens":5}}}',
               "responses", "", True)]
    for line, endpoint, text, is_last in events:
        payload = parse_line(line, endpoint)
        assert chunk_text(payload, endpoint) == text and chunk_usage(payload, endpoint, usage) is is_last
    assert usage == {"prompt": 3, "completion": 5}
    usage = {}
    for line, text, is_last in (('data: {"type":"message_start","message":{"usage":{"input_tokens":4}}}', "", False),
                                ('data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"a"}}', "a",
                                 False),
                                ('data: {"type":"message_delta","usage":{"output_tokens":2}}', "", False),
                                ('data: {"type":"message_stop"}', "", True)):
        payload = parse_line(line, "messages")
        assert chunk_text(payload, "messages") == text and chunk_usage(payload, "messages", usage) is is_last
    assert usage == {"prompt": 4, "completion": 2}
    usage = {}
    first = parse_line('{"message":{"role":"assistant","content":"x"},"done":false}', "ollama-chat")
    last = parse_line('{"message":{"content":""},"done":true,"prompt_eval_count":6,"eval_count":9}', "ollama-chat")
    assert chunk_text(first, "ollama-chat") == "x" and not chunk_usage(first, "ollama-chat", usage)
    assert chunk_usage(last, "ollama-chat", usage) and usage == {"prompt": 6, "completion": 9}


def test_tool_calling_requests_and_their_streamed_arguments():
    load = ServeLoad(base_url="http://127.0.0.1:1", tools=read_tools("builtin"))
    body = request_body(load, "m", BenchRequest("hi", 8, 1))
    assert body["tool_choice"] == "required" and body["parallel_tool_calls"] is False
    assert body["tools"][0]["function"]["parameters"]["properties"]["notes"]["minItems"] == 100
    chunk = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"ti'}}]}}]}
    assert chunk_text(chunk, "chat") == '{"ti'
    with pytest.raises(InvalidRequestError, match="--tools works with --endpoint chat"):
        request_body(ServeLoad(base_url="http://127.0.0.1:1", endpoint="completions", tools=load.tools), "m",
                     BenchRequest("hi", 8, 1))


def test_a_system_prompt_goes_before_the_user_prompt():
    load = ServeLoad(base_url="http://127.0.0.1:1", system_prompt="You can call functions.")
    assert request_body(load, "m", BenchRequest("hi", 8, 1))["messages"] == [
        {"role": "system", "content": "You can call functions."}, {"role": "user", "content": "hi"}]
