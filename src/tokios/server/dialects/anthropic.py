"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens.

A thin translation onto the shared chat path (server/generation.py): `system`, content blocks
(text, thinking, tool_use, tool_result) and Anthropic's tools and tool_choice become
OpenAI-shaped messages and a ToolSet, `thinking` and `output_config.effort` a ThinkingRequest;
the answer is a `message` with thinking, text and tool_use blocks, or the streamed event
sequence (message_start, content_block_start, content_block_delta with thinking_delta,
signature_delta, text_delta or input_json_delta, content_block_stop, message_delta with
stop_reason and usage, message_stop). Errors are Anthropic's `{"type": "error", "error": {...}}`,
in a stream as an `error` event (the `ANTHROPIC` record at the end); `x-api-key` is accepted as
the key by the guard middleware. `output_config.format` (a JSON schema) runs through the
structured-output engine. Images and documents are refused with a 400 naming the field.
temperature, top_p and top_k are read when sent (older SDKs send them; newer ones through
extra_body).

A thinking block's `signature` is empty: Anthropic signs its own models' thinking so that its
API can check what comes back; a local model's thinking has nothing to check, and the blocks a
client sends back are read for their text only (llama.cpp's server does the same).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokios.encoder.loader import GENERATE
from tokios.errors import InvalidRequestError, TokiosError
from tokios.reasoning import ThinkingRequest
from tokios.server.body import JsonBool, RequestBody, ResponseBody
from tokios.server.dialects.dialect import (NAMED, SSE, Dialect, Route, guarded_stream, join_text_parts,
                                           model_route)
from tokios.server.generation import ChatRun, ChatTurn
from tokios.server.registry import ModelLease
from tokios.server.streams import StreamedResponse
from tokios.structured.spec import StructuredOutput
from tokios.tool_calls import ToolSet


# The content blocks the translation below takes, published as the schema of a message: text in
# either role, tool_use blocks in assistant turns, tool_result blocks in user turns.
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
_TOOL_USE_BLOCK = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"const": "tool_use"}, "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"}}}
_THINKING_BLOCK = {"type": "object", "required": ["type", "thinking"], "properties": {
    "type": {"const": "thinking"}, "thinking": {"type": "string"}, "signature": {"type": "string"}}}
_REDACTED_THINKING_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"const": "redacted_thinking"}, "data": {"type": "string"}}}
_TOOL_RESULT_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"const": "tool_result"}, "tool_use_id": {"type": "string"}, "is_error": {"type": "boolean"},
    "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}]}}}


def _turn_schema(role: str, *blocks_of_role: dict[str, Any]) -> dict[str, Any]:
    blocks = {"type": "array", "items": {"anyOf": [_TEXT_BLOCK, *blocks_of_role]}}
    return {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": role}, "content": {"anyOf": [{"type": "string"}, blocks]}}}


# The efforts Anthropic names that a thinking budget stands for (reasoning/request.py's table).
_EFFORTS = ("low", "medium", "high")


class AnthropicMessage(RequestBody):
    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda schema: schema.update(
        {"anyOf": [_turn_schema("user", _TOOL_RESULT_BLOCK), _turn_schema("assistant", _TOOL_USE_BLOCK, _THINKING_BLOCK,
                                                                          _REDACTED_THINKING_BLOCK)]}))

    role: str
    content: str | list[dict[str, Any]]


class AnthropicTool(RequestBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = Field(default=None, json_schema_extra={"enum": ["custom", None]})


class CountTokensRequest(RequestBody):
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}, {"type": "null"}]})
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                                          "disable_parallel_tool_use": {"type": "boolean"}}},
        {"type": "null"}]})


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, json_schema_extra={"items": {"type": "string",
                                                                                        "minLength": 1}})
    temperature: float | None = Field(default=None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    top_k: int | None = Field(default=None, json_schema_extra={"minimum": 0})
    stream: JsonBool = False
    metadata: dict[str, Any] | None = None
    # A reasoning model's thinking (docs/apis.md, "Reasoning"): enabled with a budget in tokens
    # (less than max_tokens), adaptive (no budget but the effort's), or disabled.
    thinking: dict[str, Any] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["enabled", "adaptive", "disabled"]}, "budget_tokens": {"type": "integer", "minimum": 1},
            "display": {"enum": ["summarized", "omitted", None]}}},
        {"type": "null"}]})
    # {"format": {"type": "json_schema", "schema": {...}}}: structured output; `effort`: the
    # thinking's effort (its budget unless budget_tokens says).
    output_config: dict[str, Any] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "object", "properties": {
            "effort": {"enum": [*_EFFORTS, None]},
            "format": {"anyOf": [{"type": "object", "required": ["type"], "properties": {
                "type": {"const": "json_schema"}, "schema": {"type": "object"}}}, {"type": "null"}]}}},
        {"type": "null"}]})
    ignore_eos: JsonBool = False  # an extension (as on the OpenAI routes): benchmarks need fixed lengths


def _check_types(block: dict[str, Any], where: str, **name_to_type: type) -> None:
    """A block's optional fields, when present, are of their documented type."""
    for name, expected in name_to_type.items():
        if name in block and not isinstance(block[name], expected):
            raise InvalidRequestError(f"{where}.{name} must be a {expected.__name__}", param=f"{where}.{name}")


def to_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's system + messages -> the OpenAI-shaped messages of a ChatTurn."""
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": join_text_parts(body.system, "system", ("text",))})
    for index, message in enumerate(body.messages):
        where = f"messages.{index}"
        if message.role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where}.role must be user or assistant, got {message.role!r}",
                                      param=f"{where}.role")
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block_index, block in enumerate(message.content):
            block_where = f"{where}.content.{block_index}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "thinking" and message.role == "assistant":
                _check_types(block, block_where, thinking=str, signature=str)
                thoughts.append(block.get("thinking", ""))
            elif kind == "redacted_thinking" and message.role == "assistant":
                pass  # another server's encrypted thinking: nothing here can read it
            elif kind == "tool_use" and message.role == "assistant":
                _check_types(block, block_where, id=str)
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                    raise InvalidRequestError(f"{block_where}: a tool_use block needs a name and an input object",
                                              param=block_where)
                calls.append({"id": block.get("id") or f"toolu_{index}_{block_index}", "type": "function",
                              "function": {"name": block["name"], "arguments": block.get("input") or {}}})
            elif kind == "tool_result" and message.role == "user":
                _check_types(block, block_where, tool_use_id=str, is_error=bool)
                content = block.get("content", "")
                text = join_text_parts(content, f"{block_where}.content", ("text",)) if content else ""
                if block.get("is_error"):
                    text = f"Error: {text}"
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
            else:
                raise InvalidRequestError(f"{block_where}: blocks of type {kind!r} are not supported in a "
                                          f"{message.role} message", param=block_where)
        entry: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        if any(thoughts):  # the chat template keeps or drops a prior turn's thinking as its model expects
            entry["reasoning_content"] = "\n".join(thought for thought in thoughts if thought)
        if texts or len(entry) > 2:
            messages.append(entry)
    return messages


def to_toolset(body: CountTokensRequest) -> ToolSet | None:
    """Anthropic tools and tool_choice -> a ToolSet (through OpenAI's shapes, validated there)."""
    choice = body.tool_choice or {}
    if not isinstance(choice, dict) or choice.get("type", "auto") not in ("auto", "any", "tool", "none"):
        raise InvalidRequestError("tool_choice.type must be auto, any, tool or none", param="tool_choice")
    if not body.tools:
        if body.tool_choice and choice.get("type") != "none":
            raise InvalidRequestError("tool_choice needs tools: the request gives none", param="tool_choice")
        return None
    tools = []
    for index, tool in enumerate(body.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(f"tools.{index}.type {tool.type!r}: only custom (client) tools are supported",
                                      param=f"tools.{index}.type")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    kind = choice.get("type", "auto")
    openai_choice: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        openai_choice = {"type": "function", "function": {"name": choice.get("name")}}
    # Anthropic lets the model call several tools unless disable_parallel_tool_use is set.
    return ToolSet.from_request(tools, openai_choice, not choice.get("disable_parallel_tool_use", False))


def to_thinking(body: MessagesRequest) -> ThinkingRequest:
    """`thinking` and `output_config.effort` -> a ThinkingRequest. budget_tokens must be less than
    max_tokens, as Anthropic requires (the thinking's tokens count toward max_tokens); Anthropic's
    minimum of 1024 is not required: a small local model may be given a smaller budget."""
    thinking = body.thinking if body.thinking is not None else {}
    effort = (body.output_config or {}).get("effort")
    if effort is not None and effort not in _EFFORTS:
        raise InvalidRequestError(f"output_config.effort must be one of {list(_EFFORTS)}, got {effort!r}",
                                  param="output_config.effort")
    kind = thinking.get("type")
    if kind not in (None, "enabled", "adaptive", "disabled"):
        raise InvalidRequestError(f"thinking.type must be enabled, adaptive or disabled, got {kind!r}",
                                  param="thinking.type")
    if body.thinking is not None and kind is None:
        raise InvalidRequestError("thinking.type is required", param="thinking.type")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise InvalidRequestError("thinking.display must be summarized or omitted", param="thinking.display")
    budget = thinking.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise InvalidRequestError("thinking.budget_tokens must be an integer >= 1", param="thinking.budget_tokens")
    if kind == "disabled":
        if effort is not None:
            raise InvalidRequestError("output_config.effort sets the thinking's effort, and thinking is disabled",
                                      param="output_config.effort")
        return ThinkingRequest(False, param="thinking")
    if kind == "enabled":
        if budget is None:
            raise InvalidRequestError("thinking.budget_tokens is required when thinking is enabled",
                                      param="thinking.budget_tokens")
        if budget >= body.max_tokens:
            raise InvalidRequestError(f"thinking.budget_tokens ({budget}) must be less than max_tokens "
                                      f"({body.max_tokens}): the thinking counts toward max_tokens",
                                      param="thinking.budget_tokens")
    if kind is None and effort is None:
        return ThinkingRequest(param="thinking")
    return ThinkingRequest(True, effort, budget if kind == "enabled" else None,
                           "thinking" if kind is not None else "output_config.effort")


def _sampling(body: MessagesRequest) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"ignore_eos": body.ignore_eos}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(body, name)
        if value is not None:
            kwargs[name] = value
    output_config = body.output_config or {}
    output_format = output_config.get("format")
    if output_format is not None:
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise InvalidRequestError("output_config.format must be {type: json_schema, schema: {...}}",
                                      param="output_config.format")
        kwargs["structured_output"] = StructuredOutput.from_structured_outputs(
            {"json": output_format.get("schema")}, param="output_config.format.schema")
    if body.stop_sequences:
        if not all(body.stop_sequences):
            raise InvalidRequestError("stop_sequences must be non-empty strings", param="stop_sequences")
        kwargs["stop"] = list(body.stop_sequences)
    return kwargs


def _stop_reason(finish_reason: str | None, stop_reason: Any, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_sequences and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


def _tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call["function"]["arguments"]
    try:
        tool_input = json.loads(arguments)
    except ValueError:  # cut short by max_tokens: the stop reason says so
        tool_input = {}
    return {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": call["function"]["name"], "input": tool_input}


def _tool_use_id(call_id: str) -> str:
    return call_id if call_id.startswith("toolu_") else f"toolu_{call_id.removeprefix('call_')}"


def _usage(run: ChatRun, num_output_tokens: int) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens; nothing is
    written to a cache on request here (every computed block is cached anyway), so creation is 0.
    A reasoning model's usage also says how many output tokens were thinking."""
    num_cached = run.num_cached_prompt_tokens
    usage: dict[str, Any] = {"input_tokens": run.num_prompt_tokens - num_cached, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": num_cached, "output_tokens": num_output_tokens}
    if run.reasoning.reasoning_format is not None and num_output_tokens:
        usage["output_tokens_details"] = {"thinking_tokens": run.num_reasoning_tokens}
    return usage


def _shows_thinking(body: MessagesRequest) -> bool:
    """thinking.display "omitted": the thinking blocks come, with their text left out."""
    return (body.thinking or {}).get("display") != "omitted"


async def _stream(run: ChatRun, body: MessagesRequest, message_id: str, model: str
                  ) -> AsyncIterator[dict[str, Any]]:
    yield {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(run, num_output_tokens=0)}}
    block_index = -1
    open_kind: str | None = None  # "thinking", "text" or "tool_use": the block being written
    finish_reason = stop_reason = None
    shows_thinking = _shows_thinking(body)

    def close_block() -> list[dict[str, Any]]:
        # Anthropic sends a thinking block's signature last, just before the block's stop.
        signature = ([{"type": "content_block_delta", "index": block_index,
                       "delta": {"type": "signature_delta", "signature": ""}}] if open_kind == "thinking" else [])
        return [*signature, {"type": "content_block_stop", "index": block_index}]

    def open_block(content_block: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the block being written, if any, and start the next one."""
        nonlocal block_index, open_kind
        events = close_block() if open_kind is not None else []
        block_index += 1
        open_kind = content_block["type"]
        return [*events, {"type": "content_block_start", "index": block_index, "content_block": content_block}]

    async for delta in run.deltas():
        if delta.reasoning:
            if open_kind != "thinking":
                for event in open_block({"type": "thinking", "thinking": "", "signature": ""}):
                    yield event
            if shows_thinking:
                yield {"type": "content_block_delta", "index": block_index,
                       "delta": {"type": "thinking_delta", "thinking": delta.reasoning}}
        if delta.content:
            if open_kind != "text":
                for event in open_block({"type": "text", "text": ""}):
                    yield event
            yield {"type": "content_block_delta", "index": block_index,
                   "delta": {"type": "text_delta", "text": delta.content}}
        for call in delta.tool_calls:
            if call.id is not None:  # a new call: its own block
                for event in open_block({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name,
                                         "input": {}}):
                    yield event
            if call.arguments:
                yield {"type": "content_block_delta", "index": block_index,
                       "delta": {"type": "input_json_delta", "partial_json": call.arguments}}
        if delta.finish_reason:
            finish_reason, stop_reason = delta.finish_reason, delta.stop_reason
    if open_kind is not None:
        for event in close_block():
            yield event
    reason, sequence = _stop_reason(finish_reason, stop_reason, body.stop_sequences)
    yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
           "usage": _usage(run, run.num_completion_tokens)}
    yield {"type": "message_stop"}


async def _messages(request: Request, body: MessagesRequest, lease: ModelLease) -> Response:
    serving = lease.serving
    turn = ChatTurn(to_messages(body), _sampling(body), body.max_tokens, to_toolset(body),
                    thinking=to_thinking(body))
    message_id = f"msg_{uuid.uuid4().hex}"
    model = body.model
    chat_run = await serving.start_chat(request, turn, lease, stream=body.stream, response_id=message_id)
    if body.stream:
        return StreamedResponse(guarded_stream(ANTHROPIC, _stream(chat_run, body, message_id, model)),
                                chat_run.job)
    result = (await chat_run.results())[0]
    content: list[dict[str, Any]] = []
    if result.reasoning:  # as streamed: a block once there is thinking to show
        content.append({"type": "thinking", "thinking": result.reasoning if _shows_thinking(body) else "",
                        "signature": ""})
    if result.content:
        content.append({"type": "text", "text": result.content})
    content.extend(_tool_use_block(call) for call in result.tool_calls)
    reason, sequence = _stop_reason(result.finish_reason, result.stop_reason, body.stop_sequences)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": content, "stop_reason": reason, "stop_sequence": sequence,
                         "usage": _usage(chat_run, chat_run.num_completion_tokens)})


async def _count_tokens(request: Request, body: CountTokensRequest, lease: ModelLease) -> Response:
    turn = ChatTurn(to_messages(body), {}, tools=to_toolset(body))
    # The prompt /v1/messages would run, its template's thinking switch set as there.
    _, _, prompt_ids = lease.serving.chat_prompt(turn)
    return JSONResponse({"input_tokens": len(prompt_ids)})


_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 408: "invalid_request_error", 413: "request_too_large",
                   429: "rate_limit_error", 499: "invalid_request_error", 503: "overloaded_error"}


def error_body(error: TokiosError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPE_BY_STATUS.get(error.status, "api_error"),
                                       "message": error.message}}


class Message(ResponseBody):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None
    usage: dict[str, Any]


class MessageEvent(ResponseBody):
    """One event of a streamed message: `event:` names its `type`."""

    type: str


class TokenCount(ResponseBody):
    input_tokens: int


ANTHROPIC = Dialect(
    name="anthropic",
    routes=(
        Route("post", "/v1/messages", model_route(MessagesRequest, _messages, GENERATE),
              "Create a message (Anthropic Messages API); SSE events when stream is true", MessagesRequest, Message,
              SSE, MessageEvent, generates=True),
        Route("post", "/v1/messages/count_tokens", model_route(CountTokensRequest, _count_tokens, GENERATE),
              "Count a message request's input tokens (Anthropic)", CountTokensRequest, TokenCount),
    ),
    path_prefixes=("/v1/messages",),
    error_body=error_body,
    error_schema={"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
            "type": {"type": "string"}, "message": {"type": "string"}}}}},
    frame_style=NAMED,
    stream_error=error_body,
)
