"""OpenAI's Responses API: POST /v1/responses, GET /v1/responses/{id}, and the response store.

A thin translation onto the shared chat path (server/generation.py): `input` (a string, or
message, reasoning, function_call and function_call_output items), `instructions`, function
tools, `text.format` and `reasoning.effort` become a ChatTurn; the answer is a `response` object
whose `output` holds a reasoning item (a reasoning model's thinking, as `reasoning_text` content),
a message item and function_call items, or the typed event stream (response.created,
.in_progress, .output_item.added, .content_part.added, .reasoning_text.delta/.done,
.output_text.delta, .output_text.done, .content_part.done, .function_call_arguments.delta/.done,
.output_item.done, .completed), every event with its `sequence_number`.

`ResponseStore` keeps the last `--responses-store-size` responses (default 1000) for
`--responses-store-ttl` (default 1 h), in memory: each with its conversation, so that
`previous_response_id` continues it (the earlier `instructions` are not carried over, as OpenAI
documents) and `GET /v1/responses/{id}` returns it. `store: false` keeps a response out.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokios.encoder.loader import GENERATE
from tokios.errors import InvalidRequestError, NotFoundError, TokiosError
from tokios.reasoning import ThinkingRequest
from tokios.server.body import JsonBool, JsonInt, RequestBody, ResponseBody, parse_body
from tokios.server.dialects.dialect import SEQUENCED, SSE, Dialect, Route, guarded_stream, join_text_parts
from tokios.server.errors import openai_error_body
from tokios.server.generation import ChatRun, ChatTurn, ChoiceResult
from tokios.server.registry import ModelLease
from tokios.server.streams import StreamedResponse
from tokios.structured.spec import StructuredOutput
from tokios.tool_calls import ToolSet

DEFAULT_STORE_SIZE = 1000
DEFAULT_STORE_TTL_S = 3600.0
_TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: JsonBool | None = None
    text: dict[str, Any] | None = None
    temperature: float | None = Field(default=None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: JsonBool = False
    store: JsonBool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    # {"effort": "none" | "minimal" | "low" | "medium" | "high", "summary": ...}: a reasoning
    # model's thinking (docs/apis.md, "Reasoning"); its summary is left empty (no summarizer
    # runs here: the thinking itself is the reasoning item's content).
    reasoning: dict[str, Any] | None = None
    max_thinking_tokens: JsonInt | None = Field(default=None, ge=0)  # an extension: the budget in tokens
    truncation: str | None = None
    user: str | None = None
    seed: int | None = None  # an extension (as vLLM): reproducible sampling
    ignore_eos: JsonBool = False  # an extension (as on the chat route): benchmarks need fixed lengths


@dataclass
class StoredResponse:
    body: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation up to and including this response's output
    stored_at: float


class ResponseStore:
    """A bounded, expiring map of response id -> StoredResponse (least recently stored evicted first)."""

    def __init__(self, max_size: int = DEFAULT_STORE_SIZE, ttl_s: float = DEFAULT_STORE_TTL_S):
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, body: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._expire()
        self._responses[response_id] = StoredResponse(body, messages, time.monotonic())
        while len(self._responses) > self.max_size:
            self._responses.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> StoredResponse:
        self._expire()
        stored = self._responses.get(response_id)
        if stored is None:
            raise NotFoundError(f"No response with id {response_id!r} is stored here (the store keeps "
                                f"{self.max_size} responses for {self.ttl_s:g} s).", param=param,
                                code="response_not_found")
        return stored

    def _expire(self) -> None:
        now = time.monotonic()
        while self._responses:
            oldest = next(iter(self._responses.values()))
            if self.ttl_s < 0 or now - oldest.stored_at <= self.ttl_s:  # a negative lifetime: forever
                break
            self._responses.popitem(last=False)

    def __len__(self) -> int:
        return len(self._responses)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` -> OpenAI-shaped chat messages (function calls join the assistant turn before them)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer, got {role!r}",
                                          param=f"{where}.role")
            content = item.get("content", "")
            if content is None:
                raise InvalidRequestError(f"{where}.content must be a string or a list of text parts",
                                          param=f"{where}.content")
            text = join_text_parts(content, f"{where}.content", _TEXT_PART_TYPES)
            if role == "assistant" and _is_reasoning_only(messages):
                messages[-1]["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "reasoning":
            # A prior turn's thinking: the assistant turn it opens carries it, and the chat
            # template keeps or drops it as its model expects. Only its text can be read
            # (encrypted_content is another server's).
            reasoning = join_text_parts(item.get("content") or [], f"{where}.content", ("reasoning_text",))
            if reasoning:
                messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments", ""), str):
                raise InvalidRequestError(f"{where}: a function_call item needs name and arguments (a JSON string)",
                                          param=where)
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            elif messages and messages[-1]["role"] == "assistant":
                messages[-1]["tool_calls"] = [call]
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        else:
            raise InvalidRequestError(f"{where}.type {kind!r} is not supported; message, function_call and "
                                      "function_call_output are", param=f"{where}.type")
    return messages


def _is_reasoning_only(messages: list[dict[str, Any]]) -> bool:
    """Whether the last message is an assistant turn that has its reasoning and nothing else yet."""
    if not messages:
        return False
    last = messages[-1]
    return last["role"] == "assistant" and "reasoning_content" in last and not last["content"] and \
        "tool_calls" not in last


def _thinking(body: ResponsesRequest) -> ThinkingRequest:
    reasoning = body.reasoning or {}
    return ThinkingRequest.from_effort(reasoning.get("effort"), "reasoning.effort", body.max_thinking_tokens)


def _toolset(body: ResponsesRequest) -> ToolSet | None:
    tools = []
    for index, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise InvalidRequestError(f"tools[{index}].type {tool.get('type')!r}: only function tools are supported",
                                      param=f"tools[{index}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        tools.append({"type": "function", "function": function})
    choice: Any = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return ToolSet.from_request(tools or None, choice, body.parallel_tool_calls)


def _text_format(body: ResponsesRequest) -> StructuredOutput | None:
    """`text.format` (the Responses form of response_format: the schema sits beside the name)."""
    format_ = (body.text or {}).get("format")
    if format_ is None:
        return None
    if not isinstance(format_, dict):
        raise InvalidRequestError("text.format must be an object with a type", param="text.format")
    if format_.get("type") == "json_schema":
        as_chat = {"type": "json_schema", "json_schema": {key: value for key, value in format_.items() if key != "type"}}
        return StructuredOutput.from_response_format(as_chat, param="text.format")
    return StructuredOutput.from_response_format(format_, param="text.format")


def _sampling(body: ResponsesRequest) -> dict[str, Any]:
    if body.truncation not in (None, "disabled"):
        raise InvalidRequestError("truncation: only 'disabled' is supported (a prompt over the context is a 400)",
                                  param="truncation")
    kwargs: dict[str, Any] = {name: getattr(body, name) for name in ("temperature", "top_p", "seed")
                              if getattr(body, name) is not None}
    kwargs["ignore_eos"] = body.ignore_eos
    structured_output = _text_format(body)
    if structured_output is not None:
        kwargs["structured_output"] = structured_output
    return kwargs


class ResponseBuilder:
    """The `response` object of one run, and the ids of its output items."""

    def __init__(self, body: ResponsesRequest, model: str, run: ChatRun):
        self.body = body
        self.model = model
        self.run = run
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]], finish_reason: str | None = None) -> dict[str, Any]:
        body = self.body
        defaults = self.run.serving.sampling_defaults.field_to_value
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        response: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": "incomplete" if incomplete and status == "completed" else status,
            "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": bool(body.parallel_tool_calls), "previous_response_id": body.previous_response_id,
            # What the run used: the request's value, else the model's default.
            "temperature": body.temperature if body.temperature is not None else defaults["temperature"],
            "top_p": body.top_p if body.top_p is not None else defaults["top_p"],
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": body.metadata or {}, "store": body.store, "usage": None,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
        }
        if status != "in_progress":
            response["usage"] = {"input_tokens": self.run.num_prompt_tokens,
                                 "input_tokens_details": {"cached_tokens": self.run.num_cached_prompt_tokens},
                                 "output_tokens": self.run.num_completion_tokens,
                                 "output_tokens_details": {"reasoning_tokens": self.run.num_reasoning_tokens},
                                 "total_tokens": self.run.num_prompt_tokens + self.run.num_completion_tokens}
        return response

    def reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        """A reasoning model's thinking, whole, as OpenAI's open-weight models return it: the text as
        `reasoning_text` content, and no summary (none is made here)."""
        content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def message_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call_id.removeprefix('call_')}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def output_of(self, result: ChoiceResult) -> list[dict[str, Any]]:
        output = []
        if result.reasoning:  # as streamed: an item once there is thinking to show
            has_answer = bool(result.content or result.tool_calls)
            output.append(self.reasoning_item(result.reasoning, _reasoning_status(result.finish_reason, has_answer)))
        if result.content or not result.tool_calls:
            output.append(self.message_item(result.content or ""))
        output.extend(self.call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
                      for call in result.tool_calls)
        return output


def _reasoning_status(finish_reason: str | None, has_answer: bool) -> str:
    """A thinking that the output limit cut short (no answer followed it) is incomplete."""
    return "incomplete" if finish_reason == "length" and not has_answer else "completed"


def _output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The assistant turn a response's output adds to its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    reasoning = "".join(part["text"] for item in output if item["type"] == "reasoning"
                        for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return [message]


async def _events(builder: ResponseBuilder, on_done) -> AsyncIterator[dict[str, Any]]:
    """The typed events; the encoder (SEQUENCED) numbers them with `sequence_number`."""

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, **fields}

    yield event("response.created", response=builder.envelope("in_progress", []))
    yield event("response.in_progress", response=builder.envelope("in_progress", []))
    output: list[dict[str, Any]] = []
    text = ""
    reasoning = ""
    reasoning_index: int | None = None  # output index of the reasoning item while it is open
    message_index: int | None = None
    call_index: int | None = None  # output index of the call being written
    finish_reason = None

    def close_message() -> list[dict[str, Any]]:
        item = builder.message_item(text)
        output[message_index] = item
        part = item["content"][0]
        return [event("response.output_text.done", item_id=builder.message_id, output_index=message_index,
                      content_index=0, text=text, logprobs=[]),
                event("response.content_part.done", item_id=builder.message_id, output_index=message_index,
                      content_index=0, part=part),
                event("response.output_item.done", output_index=message_index, item=item)]

    def close_reasoning(status: str = "completed") -> list[dict[str, Any]]:
        item = builder.reasoning_item(reasoning, status)
        output[reasoning_index] = item
        ids = {"item_id": builder.reasoning_id, "output_index": reasoning_index, "content_index": 0}
        return [event("response.reasoning_text.done", **ids, text=reasoning),
                event("response.content_part.done", **ids, part=item["content"][0]),
                event("response.output_item.done", output_index=reasoning_index, item=item)]

    def close_call() -> list[dict[str, Any]]:
        item = {**output[call_index], "status": "completed"}
        output[call_index] = item
        return [event("response.function_call_arguments.done", item_id=item["id"], output_index=call_index,
                      arguments=item["arguments"]),
                event("response.output_item.done", output_index=call_index, item=item)]

    async for delta in builder.run.deltas():
        if delta.reasoning:
            if reasoning_index is None:
                reasoning_index = len(output)
                output.append(builder.reasoning_item("", status="in_progress"))
                yield event("response.output_item.added", output_index=reasoning_index, item=output[reasoning_index])
                yield event("response.content_part.added", item_id=builder.reasoning_id,
                            output_index=reasoning_index, content_index=0, part={"type": "reasoning_text", "text": ""})
            reasoning += delta.reasoning
            yield event("response.reasoning_text.delta", item_id=builder.reasoning_id, output_index=reasoning_index,
                        content_index=0, delta=delta.reasoning)
        if reasoning_index is not None and (delta.content or delta.tool_calls):  # the thinking is over
            for line in close_reasoning():
                yield line
            reasoning_index = None
        if delta.content:
            if message_index is None:
                message_index = len(output)
                output.append(builder.message_item("", status="in_progress"))
                yield event("response.output_item.added", output_index=message_index, item=output[message_index])
                yield event("response.content_part.added", item_id=builder.message_id, output_index=message_index,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            text += delta.content
            yield event("response.output_text.delta", item_id=builder.message_id, output_index=message_index,
                        content_index=0, delta=delta.content, logprobs=[])
        for call in delta.tool_calls:
            if call.id is not None:
                if call_index is not None:
                    for line in close_call():
                        yield line
                call_index = len(output)
                output.append(builder.call_item(call.id, call.name, "", status="in_progress"))
                yield event("response.output_item.added", output_index=call_index, item=output[call_index])
            if call.arguments:
                output[call_index] = {**output[call_index],
                                      "arguments": output[call_index]["arguments"] + call.arguments}
                yield event("response.function_call_arguments.delta", item_id=output[call_index]["id"],
                            output_index=call_index, delta=call.arguments)
        finish_reason = delta.finish_reason or finish_reason
    if reasoning_index is not None:
        for line in close_reasoning(_reasoning_status(finish_reason, bool(text) or call_index is not None)):
            yield line
    if message_index is None and call_index is None:  # an empty answer is still one message
        message_index = len(output)
        output.append(builder.message_item("", status="in_progress"))
        yield event("response.output_item.added", output_index=message_index, item=output[message_index])
        yield event("response.content_part.added", item_id=builder.message_id, output_index=message_index,
                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
    if message_index is not None:
        for line in close_message():
            yield line
    if call_index is not None:
        for line in close_call():
            yield line
    response = builder.envelope("completed", output, finish_reason)
    on_done(response)
    kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(kind, response=response)


async def _create_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    store: ResponseStore = state.responses_store
    body = await parse_body(request, ResponsesRequest)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = list(store.get(body.previous_response_id, "previous_response_id").messages)
    conversation = history + input_messages(body.input)
    if not conversation:
        raise InvalidRequestError("input must not be empty", param="input")

    async def run(lease: ModelLease) -> Response:
        serving = lease.serving
        instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
        turn = ChatTurn(instructions + conversation, _sampling(body), body.max_output_tokens, _toolset(body),
                        thinking=_thinking(body))
        model = serving.response_model_name(body.model)
        chat_run = await serving.start_chat(request, turn, lease, stream=body.stream,
                                            response_id=f"resp-{uuid.uuid4().hex}")
        builder = ResponseBuilder(body, model, chat_run)

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                store.put(response["id"], response, conversation + _output_messages(response["output"]))

        if body.stream:
            return StreamedResponse(guarded_stream(RESPONSES, _events(builder, keep)), chat_run.job)
        result = (await chat_run.results())[0]
        response = builder.envelope("completed", builder.output_of(result), result.finish_reason)
        keep(response)
        return JSONResponse(response)
    return await state.respond(body.model, run, needs=GENERATE)


async def _retrieve_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    return JSONResponse(state.responses_store.get(request.path_params["response_id"]).body)


def stream_error(error: TokiosError) -> dict[str, Any]:
    """The typed `error` event that ends a stream after a failure."""
    return {"type": "error", "code": error.code or error.error_type, "message": error.message, "param": error.param}


class ResponseObject(ResponseBody):
    id: str
    object: Literal["response"]
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseEvent(ResponseBody):
    """One typed event of a streamed response: `event:` names its `type`."""

    type: str
    sequence_number: int


RESPONSES = Dialect(
    name="openai_responses",
    routes=(
        Route("post", "/v1/responses", _create_route,
              "Create a response (OpenAI Responses API); typed SSE events when stream is true", ResponsesRequest,
              ResponseObject, SSE, ResponseEvent, generates=True),
        Route("get", "/v1/responses/{response_id}", _retrieve_route, "A stored response", answer=ResponseObject,
              parameters=({"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}},)),
    ),
    path_prefixes=("/v1/responses",),
    error_body=openai_error_body,
    error_schema={"$ref": "#/components/schemas/ErrorResponse"},
    frame_style=SEQUENCED,
    stream_error=stream_error,
)
