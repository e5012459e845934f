"""Shapes engine outputs into OpenAI response bodies, stream chunks and SSE frames.

Owns the JSON shapes of chat.completion, chat.completion.chunk and text_completion (plus usage
and the two logprobs formats: chat's `content` list and completions' parallel lists), and the SSE
framing (`data: {...}\\n\\n`, `data: [DONE]\\n\\n`). Pure functions over tokios.outputs types and a
token decoder; server/serving.py calls them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from tokios.outputs import Logprob, TokenLogprobs

SSE_DONE = "data: [DONE]\n\n"
# JSON has no -Infinity; OpenAI-compatible servers clamp to this floor.
MIN_LOGPROB = -9999.0

# token id -> the token's text, for logprobs (decoded_token when the engine supplied it).
TokenDecoder = Callable[[int, Logprob | None], str]


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def finite_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def _ranked(position: TokenLogprobs) -> list[tuple[int, Logprob]]:
    """Entries best first: by rank where the engine gave one, else by logprob."""
    return sorted(position.items(), key=lambda item: (
        item[1].rank if item[1].rank is not None else math.inf, -item[1].logprob))


def _top(position: TokenLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    ranked = _ranked(position)
    # The sampled token is added to the dict even when it is outside the top k; keep only the top k.
    return ranked[:num_top]


def chat_logprobs(token_ids: list[int], positions: list[TokenLogprobs], num_top: int,
                  decode: TokenDecoder) -> dict[str, Any]:
    """`{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}` for chat."""
    content = []
    for token_id, position in zip(token_ids, positions):
        sampled = position.get(token_id)
        token_text = decode(token_id, sampled)
        content.append({
            "token": token_text,
            "logprob": finite_logprob(sampled.logprob) if sampled else MIN_LOGPROB,
            "bytes": list(token_text.encode("utf-8")),
            "top_logprobs": [
                {"token": (text := decode(top_id, top)), "logprob": finite_logprob(top.logprob),
                 "bytes": list(text.encode("utf-8"))}
                for top_id, top in _top(position, num_top)],
        })
    return {"content": content}


def completion_logprobs(token_ids: list[int], positions: list[TokenLogprobs | None],
                        decode: TokenDecoder, *, initial_text_offset: int = 0) -> dict[str, Any]:
    """Completions' parallel lists; a None position (the first prompt token) gives None entries.

    top_logprobs keeps every entry the engine returned (the top k and the actual token), as
    lm-evaluation-harness checks greediness against the maximum of that dict.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offsets: list[int] = []
    text_offset = initial_text_offset
    for token_id, position in zip(token_ids, positions):
        actual = position.get(token_id) if position is not None else None
        token_text = decode(token_id, actual)
        tokens.append(token_text)
        text_offsets.append(text_offset)
        text_offset += len(token_text)
        if position is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(finite_logprob(actual.logprob) if actual else MIN_LOGPROB)
        top_logprobs.append({decode(top_id, top): finite_logprob(top.logprob)
                             for top_id, top in _ranked(position)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}


def merge_completion_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(num_prompt_tokens, num_completion_tokens),
            "system_fingerprint": None}


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
               *, include_usage: bool) -> dict[str, Any]:
    chunk = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": choices, "system_fingerprint": None}
    if include_usage:
        # OpenAI sends usage: null on every chunk but the last when include_usage is set.
        chunk["usage"] = None
    return chunk


def chat_chunk_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def text_completion(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    num_prompt_tokens: int | None, num_completion_tokens: int | None) -> dict[str, Any]:
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "system_fingerprint": None}
    if num_prompt_tokens is not None and num_completion_tokens is not None:
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens)
    return body


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage_chunk(response_id: str, created: int, model: str, obj: str, num_prompt_tokens: int,
                num_completion_tokens: int) -> dict[str, Any]:
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(num_prompt_tokens, num_completion_tokens), "system_fingerprint": None}
