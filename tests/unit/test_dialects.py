"""The dialect records: each one's stream framing, the error frame that ends a stream after a
failure, its done marker, which paths answer in its shape, and that the routes the app serves are
exactly the records' routes."""

from __future__ import annotations

import asyncio
import json

import pytest

from tokios.errors import InvalidRequestError, OverloadedError
from tokios.server.dialects import ANTHROPIC, DIALECTS, OLLAMA, OPENAI, RESPONSES, dialect_of_path
from tokios.server.dialects.dialect import guarded_stream, join_text_parts
from tokios.server.errors import error_payload


def stream_of(dialect, events, error=None) -> str:
    async def produce():
        for event in events:
            yield event
        if error is not None:
            raise error

    async def collect():
        return "".join([frame async for frame in guarded_stream(dialect, produce())])

    return asyncio.run(collect())


def sse_blocks(text: str) -> list[dict[str, str]]:
    blocks = []
    for block in text.split("\n\n"):
        if block:
            fields = dict(line.split(": ", 1) for line in block.split("\n"))
            blocks.append(fields)
    return blocks


FAILURE = InvalidRequestError("the engine refused this mid-stream", param="stop")


def test_openai_frames_data_events_then_done_also_after_an_error():
    clean = sse_blocks(stream_of(OPENAI, [{"n": 1}]))
    assert clean == [{"data": '{"n":1}'}, {"data": "[DONE]"}]
    failed = sse_blocks(stream_of(OPENAI, [{"n": 1}], FAILURE))
    assert [block["data"] for block in failed][-1] == "[DONE]" and len(failed) == 3
    assert json.loads(failed[1]["data"]) == {"error": {"message": "the engine refused this mid-stream",
                                                       "type": "invalid_request_error", "param": "stop",
                                                       "code": None}}


def test_anthropic_names_each_event_by_its_type_and_ends_with_an_error_event_without_done():
    clean = sse_blocks(stream_of(ANTHROPIC, [{"type": "message_start"}, {"type": "message_stop"}]))
    assert [block["event"] for block in clean] == ["message_start", "message_stop"]
    failed = sse_blocks(stream_of(ANTHROPIC, [{"type": "message_start"}], FAILURE))
    assert failed[-1]["event"] == "error" and len(failed) == 2
    assert json.loads(failed[-1]["data"]) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "the engine refused this mid-stream"}}
    assert ANTHROPIC.done_marker is None


def test_responses_number_every_event_including_the_error_that_ends_the_stream():
    failed = sse_blocks(stream_of(RESPONSES, [{"type": "response.created"}, {"type": "response.in_progress"}],
                                  FAILURE))
    payloads = [json.loads(block["data"]) for block in failed]
    assert [payload["sequence_number"] for payload in payloads] == [0, 1, 2]
    assert failed[-1]["event"] == "error"
    assert payloads[-1] == {"type": "error", "sequence_number": 2, "code": "invalid_request_error",
                            "message": "the engine refused this mid-stream", "param": "stop"}
    # A relay that already passed events on continues their count.
    relayed = RESPONSES.closing_frames(FAILURE, RESPONSES.encoder(first_sequence_number=7))
    assert json.loads(sse_blocks(relayed)[0]["data"])["sequence_number"] == 7


def test_ollama_writes_json_lines_and_ends_with_an_error_line():
    text = stream_of(OLLAMA, [{"response": "a", "done": False}], FAILURE)
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 2
    assert json.loads(lines[0]) == {"response": "a", "done": False}
    assert json.loads(lines[1]) == {"error": "the engine refused this mid-stream"}
    assert OLLAMA.done_marker is None and OLLAMA.frame_end == "\n" and OPENAI.frame_end == "\n\n"


def test_an_unexpected_error_mid_stream_tells_nothing_of_its_internals():
    text = stream_of(OLLAMA, [], RuntimeError("secret path /home/x"))
    assert "secret" not in text and json.loads(text)["error"]


@pytest.mark.parametrize("path, dialect", [
    ("/v1/chat/completions", OPENAI), ("/tokenize", OPENAI), ("/health", OPENAI), ("/nowhere", OPENAI),
    ("/v1/responses", RESPONSES), ("/v1/responses/resp_1", RESPONSES),
    ("/v1/messages", ANTHROPIC), ("/v1/messages/count_tokens", ANTHROPIC), ("/v1/messagesx", OPENAI),
    ("/api/chat", OLLAMA), ("/api/unknown", OLLAMA),
])
def test_each_path_answers_in_one_dialect(path, dialect):
    assert dialect_of_path(path) is dialect


def test_each_dialect_shapes_its_errors_and_overload_waits_at_least_a_second():
    error = OverloadedError("queue full", retry_after_s=0.2)
    bodies = {dialect.name: error_payload(error, dialect) for dialect in DIALECTS}
    assert {status for status, _, _ in bodies.values()} == {429}
    assert {headers["Retry-After"] for _, _, headers in bodies.values()} == {"1"}
    assert bodies["ollama"][1] == {"error": "queue full"}
    assert bodies["anthropic"][1] == {"type": "error", "error": {"type": "rate_limit_error", "message": "queue full"}}
    assert bodies["openai"][1] == bodies["openai_responses"][1] == {
        "error": {"message": "queue full", "type": "rate_limit_error", "param": None, "code": "overloaded"}}
    assert error_payload(OverloadedError("x", retry_after_s=1.5))[2]["Retry-After"] == "2"


def test_the_app_serves_exactly_the_records_routes_and_no_path_twice():
    from tokios.server.app import create_app
    from tokios.server.serving import ServerSettings

    app = create_app(ServerSettings(), engine_loader=lambda: None)
    served = {(method.lower(), route.path) for route in app.routes for method in getattr(route, "methods", ()) or ()}
    declared = [(route.method, route.path) for dialect in DIALECTS for route in dialect.routes]
    assert len(declared) == len(set(declared))
    assert set(declared) <= served
    for dialect in DIALECTS:
        for route in dialect.routes:
            assert dialect_of_path(route.path) is dialect, route.path


def test_text_parts_are_joined_and_other_parts_refused_by_where_they_are():
    assert join_text_parts([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "m", ("text",)) == "a\nb"
    assert join_text_parts(None, "m", ("text",)) == "" and join_text_parts("s", "m", ("text",)) == "s"
    with pytest.raises(InvalidRequestError) as info:
        join_text_parts([{"type": "image"}], "input[0].content", ("input_text",), param="input")
    assert info.value.param == "input" and "input[0].content[0]" in info.value.message


def test_a_tool_message_without_its_call_id_is_refused():
    from pydantic import ValidationError

    from tokios.server.dialects.openai.protocol import ChatCompletionRequest

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "18 degrees"}]})
    status, body, _ = error_payload(info.value)
    assert status == 400 and "tool_call_id" in body["error"]["message"]
    ChatCompletionRequest.model_validate({"messages": [{"role": "tool", "content": "x", "tool_call_id": "call_1"}]})
