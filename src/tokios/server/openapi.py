"""The server's OpenAPI document (GET /openapi.json): every route with its real request and
response schemas.

The routes parse their bodies by hand (server/app.py `parse_body`) so that every malformed body
gets OpenAI's error shape and wording; FastAPI therefore sees no body parameters and would
publish nothing useful. This module writes the document instead: request bodies from the same
pydantic models the routes validate with (server/protocol.py), responses from the models below,
which describe what server/responses.py builds, and the error body of server/errors.py for every
other status. `tests/e2e/test_server_fuzz.py` fuzzes the server against this document with
schemathesis, so a schema that drifts from the handlers fails the suite.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from tokios.server.dialects import DIALECT_OPENAPI_ROUTES
from tokios.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                    TokenizeRequest)

REF_TEMPLATE = "#/components/schemas/{model}"


class _Out(BaseModel):
    # Responses may grow fields; the document promises the ones listed.
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    error: ErrorDetail


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatMessageOut(_Out):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletion(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class TextCompletion(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    state: Literal["unloaded", "loading", "loaded"]
    max_model_len: int | None = None  # known once loaded


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Out):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Out):
    prompt: str


class Embedding(_Out):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingList(_Out):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: dict[str, int]


class TokenizerInfo(_Out):
    model: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str | None
    model_max_length: int


class Health(_Out):
    status: str
    error: str | None = None
    generated_tokens: int | None = None
    latency_ms: float | None = None


class ProcessStats(_Out):
    rss_bytes: int
    num_open_fds: int
    num_asyncio_tasks: int


class EngineStatsResponse(_Out):
    model: str
    num_running: int
    num_waiting: int
    num_blocks_total: int
    num_blocks_used: int
    num_steps: int
    num_unfinished_requests: int
    num_requests_in_flight: int
    invariants_error: str | None
    process: ProcessStats


REQUEST_MODELS = [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest] + [
    body for _, _, body, _ in DIALECT_OPENAPI_ROUTES.values() if body is not None]
class CacheEventsResponse(_Out):
    model: str
    log_id: str
    next: int
    reset: bool
    block_size: int
    root_hash: str
    stored: list[str]
    removed: list[str]


RESPONSE_MODELS = [ErrorResponse, ChatCompletion, TextCompletion, ModelList, TokenizeResponse, DetokenizeResponse,
                   TokenizerInfo, EmbeddingList,
                   Health, EngineStatsResponse, CacheEventsResponse]

# One schema per event (as OpenAPI 3.2's itemSchema): `data` holds a JSON chunk, an error body
# after a failure mid-stream, or the final `[DONE]`.
SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "contentMediaType": "application/json"},
                   "event": {"type": "string"}},
    "description": "Server-sent events: `data: {chunk}` lines, then `data: [DONE]`"}}}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=model.__name__)}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(statuses: list[int]) -> dict[str, Any]:
    descriptions = {400: "Invalid request", 401: "Missing or wrong API key", 404: "Unknown model",
                    408: "Body not received within --request-body-timeout",
                    413: "Body larger than --max-body-size", 429: "Queue full (Retry-After)",
                    500: "Engine failure", 503: "Loading, draining, stalled or failed (Retry-After)"}
    return {str(status): {"description": descriptions[status], "content": _json(ErrorResponse)}
            for status in statuses}


def _operation(summary: str, ok: dict[str, Any], errors: list[int], body: type[BaseModel] | None = None,
               parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK", "content": ok},
                                                                   **_errors(errors)}}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json(body)}
    if parameters:
        operation["parameters"] = parameters
    return operation


# The error bodies of the other dialects (server/errors.py), by path prefix.
_OLLAMA_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_NOT_FOUND_ERRORS = [400, 401, 404, 408, 413, 503]


def _dialect_operation(path: str, summary: str, body: type[BaseModel] | None, stream_type: str | None,
                       generates: bool) -> dict[str, Any]:
    error_schema = (_OLLAMA_ERROR if path.startswith("/api/") else
                    _ANTHROPIC_ERROR if path.startswith("/v1/messages") else _ref(ErrorResponse))
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if stream_type == "text/event-stream":
        ok.update(SSE)
    elif stream_type is not None:
        ok[stream_type] = {"schema": {"type": "object", "description": "one JSON object per line"}}
    statuses = [400, 401, 404, 408, 413, 429, 500, 503] if generates else (
        _NOT_FOUND_ERRORS if body is not None or "{" in path else [401, 503])
    responses = {"200": {"description": "OK", "content": ok}}
    for status in statuses:
        responses[str(status)] = {"description": "Error", "content": {"application/json": {"schema": error_schema}}}
    operation: dict[str, Any] = {"summary": summary, "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": _json(body)}
    if "{response_id}" in path:
        operation["parameters"] = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return operation


def build_openapi(title: str, version: str, protect_metrics: bool) -> dict[str, Any]:
    """The document; `protect_metrics` says whether /health, /metrics and the stats need a key."""
    _, definitions = models_json_schema([(model, "validation") for model in REQUEST_MODELS] +
                                        [(model, "serialization") for model in RESPONSE_MODELS],
                                        ref_template=REF_TEMPLATE)
    generate_errors = [400, 401, 404, 408, 413, 429, 500, 503]
    open_errors = [401] if protect_metrics else []
    paths = {
        "/v1/chat/completions": {"post": _operation(
            "Chat completion (OpenAI)", {**_json(ChatCompletion), **SSE}, generate_errors, ChatCompletionRequest)},
        "/v1/completions": {"post": _operation(
            "Text completion (OpenAI)", {**_json(TextCompletion), **SSE}, generate_errors, CompletionRequest)},
        "/v1/models": {"get": _operation("Served models", _json(ModelList), [401, 503])},
        "/v1/embeddings": {"post": _operation(
            "Embeddings (OpenAI): pooled, normalized final hidden states", _json(EmbeddingList), generate_errors,
            EmbeddingRequest)},
        "/tokenize": {"post": _operation("Text or messages to token ids", _json(TokenizeResponse),
                                         [400, 401, 404, 408, 413, 503], TokenizeRequest)},
        "/detokenize": {"post": _operation("Token ids to text", _json(DetokenizeResponse),
                                           [400, 401, 404, 408, 413, 503], DetokenizeRequest)},
        "/tokenizer_info": {"get": _operation(
            "Special tokens, chat template and context length (a remote tokenizer's view, as vLLM serves it)",
            _json(TokenizerInfo), [400, 401, 404, 503],
            parameters=[{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "which model (default: the first)"}])},
        "/health": {"get": _operation(
            "Readiness: 200 while the engine makes progress; with generate=1, after one generated token",
            _json(Health), open_errors + [400, 503],
            parameters=[{"name": "generate", "in": "query", "required": False, "schema": {"type": "boolean"},
                         "description": "run a one-token generation within --health-generate-timeout"}])},
        "/metrics": {"get": _operation("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                                       open_errors)},
        "/v1/engine/cache_events": {"get": _operation(
            "The prefix cache's stored and dropped block hashes since a reader's last call (for the gateway's "
            "prefix-aware routing)", _json(CacheEventsResponse), [400, 401, 404, 503],
            parameters=[{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "which model (default: the first)"},
                        {"name": "since", "in": "query", "required": False, "schema": {"type": "integer"},
                         "description": "the `next` of the reader's last call (default -1: a snapshot)"},
                        {"name": "log_id", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "the `log_id` of the reader's last call"}])},
        "/v1/engine/stats": {"get": _operation(
            "A loaded model's engine counters and the KV invariants", _json(EngineStatsResponse),
            open_errors + [404, 503],
            parameters=[{"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                         "description": "which model (default: the first)"}])},
    }
    for path, (method, summary, body, stream_type) in DIALECT_OPENAPI_ROUTES.items():
        generates = path in ("/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/v1/messages",
                             "/v1/responses")
        paths[path] = {method: _dialect_operation(path, summary, body, stream_type, generates)}
    # The 503 of /health is its answer, not an error body: same schema as its 200.
    paths["/health"]["get"]["responses"]["503"] = {"description": "Not ready", "content": _json(Health)}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": definitions.get("$defs", {})},
    }
    return document
