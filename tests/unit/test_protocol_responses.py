"""Response shaping: SSE framing, logprobs formats and the error mapping."""

from __future__ import annotations

import json
import math

from pydantic import ValidationError
from starlette.exceptions import HTTPException

from tokios.errors import ContextLengthExceededError, InvalidRequestError, OverloadedError
from tokios.outputs import Logprob
from tokios.server.dialects import OPENAI
from tokios.server.dialects.dialect import guarded_stream
from tokios.server.dialects.openai import shapes as responses
from tokios.server.dialects.openai.protocol import ChatCompletionRequest
from tokios.server.errors import error_payload

TOKEN_TEXT = {1: "Hello", 2: " world", 3: "!", 4: " there"}


def decode(token_id: int, logprob: Logprob | None) -> str:
    return TOKEN_TEXT[token_id]


def parse_sse(text: str) -> list:
    """Splits an SSE body the way clients do: events separated by blank lines, `data: ` prefix."""
    events = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_sse_frames_are_single_line_json_and_end_with_done():
    text = OPENAI.encoder().encode({"content": "line1\nline2", "emoji": "é🙂"}) + OPENAI.done_marker
    assert text.count("\n\n") == 2
    assert parse_sse(text) == [{"content": "line1\nline2", "emoji": "é🙂"}, "[DONE]"]


def test_chat_chunk_with_include_usage_carries_null_usage():
    chunk = responses.chat_chunk("id", 1, "m", [], include_usage=True)
    assert "usage" in chunk and chunk["usage"] is None
    assert "usage" not in responses.chat_chunk("id", 1, "m", [], include_usage=False)
    final = responses.usage_chunk("id", 1, "m", "chat.completion.chunk", 5, 3, 2)
    assert final["choices"] == [] and final["usage"] == {"prompt_tokens": 5, "completion_tokens": 3,
                                                         "total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 2}}


def test_chat_logprobs_keep_the_top_k_by_rank_and_clamp_minus_infinity():
    positions = [
        {1: Logprob(-0.1, rank=1), 2: Logprob(-2.5, rank=2), 3: Logprob(-3.0, rank=3)},
        # the sampled token (4) is outside the top 2 and arrives as an extra entry
        {1: Logprob(-0.5, rank=1), 2: Logprob(-1.0, rank=2), 4: Logprob(-math.inf, rank=30)},
    ]
    content = responses.chat_logprobs([1, 4], positions, num_top=2, decode=decode)["content"]
    assert [entry["token"] for entry in content] == ["Hello", " there"]
    assert content[0]["logprob"] == -0.1
    assert content[1]["logprob"] == responses.MIN_LOGPROB
    assert [top["token"] for top in content[0]["top_logprobs"]] == ["Hello", " world"]
    assert [top["token"] for top in content[1]["top_logprobs"]] == ["Hello", " world"]
    assert content[0]["bytes"] == list(b"Hello")
    json.dumps(content, allow_nan=False)


def test_completion_logprobs_with_echo_have_none_first_and_running_text_offsets():
    prompt_positions = [None, {2: Logprob(-1.5, rank=2), 3: Logprob(-0.2, rank=1)}]
    prompt_part = responses.completion_logprobs([1, 2], prompt_positions, decode)
    generated = responses.completion_logprobs([3], [{3: Logprob(-0.3, rank=1)}], decode,
                                              initial_text_offset=len("Hello world"))
    merged = responses.merge_completion_logprobs(prompt_part, generated)
    assert merged["tokens"] == ["Hello", " world", "!"]
    assert merged["token_logprobs"] == [None, -1.5, -0.3]
    # the dict holds the top-1 and the actual token, so max(values) tells greediness (lm-eval)
    assert merged["top_logprobs"] == [None, {"!": -0.2, " world": -1.5}, {"!": -0.3}]
    assert merged["text_offset"] == [0, 5, 11]


def test_errors_map_to_openai_shape_and_status():
    status, body, headers = error_payload(InvalidRequestError("temperature must be >= 0", param="temperature"))
    assert status == 400
    assert body == {"error": {"message": "temperature must be >= 0", "type": "invalid_request_error",
                              "param": "temperature", "code": None}}
    status, body, _ = error_payload(ContextLengthExceededError("too long"))
    assert (status, body["error"]["code"]) == (400, "context_length_exceeded")
    status, _, headers = error_payload(OverloadedError("busy", status=429, retry_after_s=2.5))
    assert status == 429 and headers == {"Retry-After": "3"}
    status, body, _ = error_payload(HTTPException(404, "Not Found"))
    assert status == 404 and body["error"]["type"] == "not_found_error"


def test_validation_errors_become_400_naming_the_field():
    try:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": "many"})
    except ValidationError as exc:
        status, body, _ = error_payload(exc)
    assert status == 400 and body["error"]["param"] == "n" and "n:" in body["error"]["message"]
    try:
        ChatCompletionRequest.model_validate({})
    except ValidationError as exc:
        status, body, _ = error_payload(exc)
    assert status == 400 and body["error"]["message"] == "messages is required"


def test_plain_value_error_names_a_known_field_only():
    assert error_payload(ValueError("top_p must be in (0, 1]"))[1]["error"]["param"] == "top_p"
    assert error_payload(ValueError("Something odd"))[1]["error"]["param"] is None


def test_unexpected_errors_are_500_without_internals():
    status, body, _ = error_payload(RuntimeError("secret path /home/x"))
    assert status == 500
    assert "secret" not in body["error"]["message"]


def test_an_error_after_the_stream_started_is_an_error_event_then_done():
    async def events():
        yield {"n": 1}
        raise InvalidRequestError("the engine refused this request mid-stream", param="stop")

    async def collect():
        return [frame async for frame in guarded_stream(OPENAI, events())]

    import asyncio
    frames = parse_sse("".join(asyncio.run(collect())))
    assert frames[0] == {"n": 1}
    assert frames[1] == {"error": {"message": "the engine refused this request mid-stream",
                                   "type": "invalid_request_error", "param": "stop", "code": None}}
    assert frames[2] == "[DONE]" and len(frames) == 3


def test_a_clean_stream_ends_with_exactly_one_done():
    async def events():
        for index in range(3):
            yield {"n": index}

    async def collect():
        return [frame async for frame in guarded_stream(OPENAI, events())]

    import asyncio
    frames = parse_sse("".join(asyncio.run(collect())))
    assert frames == [{"n": 0}, {"n": 1}, {"n": 2}, "[DONE]"]
