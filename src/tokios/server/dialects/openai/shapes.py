"""Shapes engine outputs into OpenAI response bodies and stream chunks, and describes them.

Owns the JSON shapes of chat.completion, chat.completion.chunk and text_completion (plus usage
and the two logprobs formats: chat's `content` list and completions' parallel lists) and the
done marker that ends their streams. Pure functions over tokios.outputs types and a token
decoder (server/logprobs.py ranks and clamps the values); dialects/openai/endpoints.py calls them.
The models at the end are the same shapes as schemas, for /openapi.json (server/openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from tokios.outputs import TokenLogprobs
from tokios.server.body import ResponseBody
from tokios.server.logprobs import MIN_LOGPROB, TokenDecoder, finite_logprob, ranked, top_ranked

SSE_DONE = "data: [DONE]\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_prompt_tokens: int,
          num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; cached_tokens are the prompt tokens the prefix cache served (part of
    prompt_tokens), and a reasoning model's answer also counts its thinking's tokens."""
    body: dict[str, Any] = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
                            "total_tokens": num_prompt_tokens + num_completion_tokens,
                            "prompt_tokens_details": {"cached_tokens": num_cached_prompt_tokens}}
    if num_reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return body


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
                for top_id, top in top_ranked(position, num_top)],
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
                             for top_id, top in ranked(position)})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offsets}


def merge_completion_logprobs(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}


def chat_completion(response_id: str, created: int, model: str, choices: list[dict[str, Any]],
                    num_prompt_tokens: int, num_completion_tokens: int,
                    num_cached_prompt_tokens: int, num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens, num_cached_prompt_tokens, num_reasoning_tokens),
            "system_fingerprint": None}


def reasoning_fields(reasoning: str) -> dict[str, str]:
    """A message's (or a delta's) reasoning under both names clients read: `reasoning_content`
    (vLLM, llama.cpp, DeepSeek) and `reasoning` (vLLM's newer name, OpenRouter)."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: dict[str, Any] | None, tool_calls: list[dict[str, Any]] | None = None,
                reasoning: str | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message.update(reasoning_fields(reasoning))
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
                    num_prompt_tokens: int | None, num_completion_tokens: int | None,
                    num_cached_prompt_tokens: int = 0) -> dict[str, Any]:
    body = {"id": response_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "system_fingerprint": None}
    if num_prompt_tokens is not None and num_completion_tokens is not None:
        body["usage"] = usage(num_prompt_tokens, num_completion_tokens, num_cached_prompt_tokens)
    return body


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def usage_chunk(response_id: str, created: int, model: str, obj: str, num_prompt_tokens: int,
                num_completion_tokens: int, num_cached_prompt_tokens: int,
                num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(num_prompt_tokens, num_completion_tokens, num_cached_prompt_tokens, num_reasoning_tokens),
            "system_fingerprint": None}


# ---- the answers' schemas, as /openapi.json publishes them -----------------------------------------

class CompletionTokensDetails(ResponseBody):
    reasoning_tokens: int


class PromptTokensDetails(ResponseBody):
    cached_tokens: int


class Usage(ResponseBody):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = None


class ChatMessageOut(ResponseBody):
    role: Literal["assistant"]
    content: str | None
    # A reasoning model's thinking, under both names clients read.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(ResponseBody):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(ResponseBody):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(ResponseBody):
    index: int
    delta: dict[str, Any]
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(ResponseBody):
    """One event of a streamed chat completion (the last may carry only usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(ResponseBody):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class TextCompletion(ResponseBody):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(ResponseBody):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    state: Literal["unloaded", "loading", "loaded"]
    kind: Literal["generate", "embedding", "rerank"]
    max_model_len: int | None = None  # known once loaded
    # A generative model's sampling for the fields a request leaves unset, and each one's source
    # ("flag", "model" or "tokios"; tokios/sampling_defaults.py).
    sampling_defaults: SamplingDefaultsCard | None = None


class SamplingDefaultsCard(ResponseBody):
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    source: dict[str, Literal["flag", "model", "tokios"]]


class ModelList(ResponseBody):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(ResponseBody):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(ResponseBody):
    prompt: str


class Embedding(ResponseBody):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(ResponseBody):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


class TokenizerInfo(ResponseBody):
    model: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int
