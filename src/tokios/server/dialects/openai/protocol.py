"""The OpenAI-compatible request bodies and how they become SamplingParams.

Owns the pydantic models of `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`,
`/tokenize` and `/detokenize` (OpenAI field names plus vLLM-style extensions), and
`sampling_kwargs`, which turns a validated request into the keyword arguments of
tokios.sampling_params.SamplingParams. Range checks that need the model (logit_bias token ids)
take the vocabulary size as an argument; the rest of the range checks live in SamplingParams
itself. Talks to nothing: dialects/openai/endpoints.py parses bodies with these models (the same
models /openapi.json publishes) and dialects/openai/shapes.py shapes the answers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator

from tokios.errors import InvalidRequestError
from tokios.reasoning import ThinkingRequest
from tokios.server.body import MAX_TOP_LOGPROBS, JsonBool, JsonFloat, JsonInt, RequestBody, TokenId
from tokios.server.dialects.dialect import join_text_parts
from tokios.structured.spec import StructuredOutput

MAX_N = 16
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class StreamOptions(RequestBody):
    include_usage: JsonBool = False


class SamplingFields(RequestBody):
    """Fields shared by chat and completions; all optional so that defaults stay in one place."""

    model: str | None = None
    n: JsonInt = Field(default=1, ge=1, le=MAX_N)
    max_tokens: JsonInt | None = Field(default=None, ge=0)
    # The ranges below are documented in the OpenAPI schema; SamplingParams enforces them with
    # messages that name the field (pydantic would word them differently).
    temperature: JsonFloat | None = Field(default=None, json_schema_extra={"minimum": 0})
    top_p: JsonFloat | None = Field(default=None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    stop: str | list[str] | None = None
    seed: JsonInt | None = None
    stream: JsonBool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: JsonFloat | None = Field(default=None, json_schema_extra={"minimum": -2, "maximum": 2})
    presence_penalty: JsonFloat | None = Field(default=None, json_schema_extra={"minimum": -2, "maximum": 2})
    logit_bias: dict[str, JsonFloat] | None = Field(default=None, json_schema_extra={
        "propertyNames": {"pattern": "^[0-9]+$"}, "additionalProperties": {"minimum": -100, "maximum": 100}})
    user: str | None = None
    # Extensions (vLLM names).
    top_k: JsonInt | None = Field(default=None, json_schema_extra={"minimum": -1})
    min_p: JsonFloat | None = Field(default=None, json_schema_extra={"minimum": 0, "maximum": 1})
    repetition_penalty: JsonFloat | None = Field(default=None, json_schema_extra={"exclusiveMinimum": 0})
    min_tokens: JsonInt | None = Field(default=None, json_schema_extra={"minimum": 0})
    ignore_eos: JsonBool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: JsonBool = True
    include_stop_str_in_output: JsonBool = False
    # Speculative decoding for this request: {"method": ..., "num_tokens": ...}, validated by SamplingParams.
    speculative: Any = None
    # Constrained decoding, vLLM's field: exactly one of json, json_object, regex, choice, grammar.
    structured_outputs: dict[str, Any] | None = Field(default=None, json_schema_extra={
        "description": "One of: json (a JSON schema), json_object (true), regex, choice (a list of strings), "
                       "grammar (Lark or GBNF)."})

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stop_strings = [value] if isinstance(value, str) else value
        if any(not text for text in stop_strings):
            raise ValueError("stop strings must be non-empty")
        return stop_strings

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def structured_output(self) -> StructuredOutput | None:
        """What the output must match, if anything (InvalidRequestError naming the field when malformed)."""
        return StructuredOutput.from_structured_outputs(self.structured_outputs)


class ContentPart(RequestBody):
    type: str
    text: str | None = None


class ToolCallFunction(RequestBody):
    name: str
    arguments: str | dict[str, Any] = "{}"


class MessageToolCall(RequestBody):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    # A tool result names the call it answers (OpenAI refuses one without): in the published
    # schema as well as in validation.
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "if": {"properties": {"role": {"const": "tool"}}, "required": ["role"]},
        "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant turn's calls, and a tool result's call id (history of a tool-using conversation).
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # A prior assistant turn's thinking, as this server returned it (either name); the chat
    # template keeps or drops it as its model expects.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _tool_results_name_their_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self, where: str = "messages") -> str:
        """The message's text; only text parts are supported (`where` names the message)."""
        return join_text_parts(self.content, f"{where}.content", ("text",), param="messages")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: JsonInt | None = Field(default=None, ge=0)
    logprobs: JsonBool = False
    top_logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: JsonBool = True
    # Tool calling (tokios.tool_calls validates the shapes, so that errors name the exact field).
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: JsonBool | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict[str, Any] | None = None
    # A reasoning model's thinking (docs/apis.md, "Reasoning"): an effort ("none" turns it off),
    # a budget in tokens, and variables for the chat template (enable_thinking, ...).
    reasoning_effort: str | None = Field(default=None, json_schema_extra={
        "enum": ["none", "minimal", "low", "medium", "high"]})
    max_thinking_tokens: JsonInt | None = Field(default=None, ge=0)
    chat_template_kwargs: dict[str, Any] | None = None

    def thinking_request(self) -> ThinkingRequest:
        return ThinkingRequest.from_effort(self.reasoning_effort, "reasoning_effort", self.max_thinking_tokens)

    def check_supported(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")

    def structured_output(self) -> StructuredOutput | None:
        from_format = StructuredOutput.from_response_format(self.response_format)
        from_fields = super().structured_output()
        if from_format is not None and from_fields is not None:
            raise InvalidRequestError("give response_format or structured_outputs, not both",
                                      param="structured_outputs")
        return from_format or from_fields

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        messages = []
        for index, message in enumerate(self.messages):
            entry: dict[str, Any] = {"role": message.role, "content": message.text(f"messages[{index}]")}
            if message.tool_calls:
                entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            reasoning = message.reasoning_content or message.reasoning
            if reasoning:
                entry["reasoning_content"] = reasoning
            messages.append(entry)
        return messages

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is OpenAI's newer name; it wins when both are given.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _texts_or_token_ids(value: Any) -> Any:
    # Checked first: for a list mixing the two, pydantic would report only why the list is not a
    # string ("input.str: Input should be a valid string").
    if isinstance(value, list) and any(isinstance(item, str) for item in value) \
            and not all(isinstance(item, str) for item in value):
        raise ValueError("a list mixes texts and token ids; send a list of texts or a list of token id lists")
    return value


PromptInput = Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], BeforeValidator(_texts_or_token_ids)]


def prompt_list(value: PromptInput, param: str) -> list[str | list[int]]:
    """A completions prompt or an embeddings input, in its four accepted shapes, as a list of
    texts or token id lists."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    if all(isinstance(item, int) for item in value):
        return [list(value)]  # type: ignore[arg-type]
    items: list[str | list[int]] = list(value)  # type: ignore[arg-type]
    if any(isinstance(item, list) and not item for item in items):
        raise InvalidRequestError(f"{param} token lists must not be empty", param=param)
    return items


class CompletionRequest(SamplingFields):
    # check_supported's refusals, published too: max_tokens 0 only with echo (prompt scoring),
    # no prompt logprobs in a stream.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"allOf": [
        {"if": {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]},
         "then": {"properties": {"echo": {"const": True}}, "required": ["echo"]}},
        {"if": {"properties": {"stream": {"const": True}, "echo": {"const": True},
                               "logprobs": {"type": "integer"}}, "required": ["stream", "echo", "logprobs"]},
         "then": False}]})

    prompt: PromptInput
    echo: JsonBool = False
    logprobs: JsonInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = Field(default=None, json_schema_extra={
        "maxLength": 0, "description": "not supported: a non-empty one is a 400"})
    best_of: JsonInt | None = Field(default=None, json_schema_extra={"description": "absent or equal to n"})

    def check_supported(self) -> None:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by this server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of must be absent or equal to n", param="best_of")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 unless echo is true", param="max_tokens")
        if self.stream and self.echo and self.logprobs is not None:
            # Prompt logprobs arrive only at the end; non-streaming is the way lm-eval asks.
            raise InvalidRequestError("echo with logprobs is supported without stream only", param="echo")

    def prompts(self) -> list[str | list[int]]:
        return prompt_list(self.prompt, "prompt")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(RequestBody):
    # Exactly one of prompt and messages (check_supported), in the published schema too.
    model_config = ConfigDict(extra="ignore", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}},
         "not": {"required": ["messages"], "properties": {"messages": {"type": "array"}}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}},
         "not": {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: JsonBool = True
    add_generation_prompt: JsonBool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("exactly one of prompt and messages must be given", param="prompt")


class EmbeddingRequest(RequestBody):
    model: str | None = None
    # Texts must not be empty, nor token id lists (a constraint on whichever shape is sent).
    input: PromptInput = Field(json_schema_extra={"minLength": 1, "minItems": 1,
                                                  "items": {"minLength": 1, "minItems": 1}})
    encoding_format: Literal["float", "base64"] = "float"
    # The bound inside the type, so that /openapi.json publishes it as a minimum.
    dimensions: Annotated[JsonInt, Field(ge=1)] | None = None
    user: str | None = None
    # Extensions: the model's declared prompt to put before each text ("query", "document"; its
    # sentence-transformers prompts), or Cohere's / NVIDIA's input_type naming the same; and
    # whether an input past the model's limit is cut (default: a 400).
    prompt_name: str | None = None
    input_type: Literal["query", "document", "search_query", "search_document"] | None = None
    truncate: JsonBool = False

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input, "input")

    def chosen_prompt_name(self) -> str | None:
        if self.prompt_name is not None and self.input_type is not None:
            raise InvalidRequestError("give prompt_name or input_type, not both", param="input_type")
        if self.input_type is not None:
            return self.input_type.removeprefix("search_")
        return self.prompt_name


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


def parse_logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); the engine wants ints."""
    if not logit_bias:
        return None
    token_id_to_bias: dict[int, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"logit_bias token id {token_id} is out of range 0..{vocab_size - 1}", param="logit_bias")
        if not low <= bias <= high:
            raise InvalidRequestError(
                f"logit_bias values must be in {low:g}..{high:g}, got {bias} for token {token_id}",
                param="logit_bias")
        token_id_to_bias[token_id] = float(bias)
    return token_id_to_bias


def sampling_kwargs(request: ChatCompletionRequest | CompletionRequest, *, vocab_size: int,
                    max_tokens: int | None = None) -> dict[str, Any]:
    """Keyword arguments for SamplingParams; an unset field is left out (the model's sampling
    defaults fill it: Serving.sampling_params).

    `max_tokens` is usually resolved later (it depends on the prompt length when absent).
    """
    kwargs: dict[str, Any] = {
        "n": request.n,
        "ignore_eos": request.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
        "include_stop_str_in_output": request.include_stop_str_in_output,
    }
    optional = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "seed": request.seed,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
        "repetition_penalty": request.repetition_penalty,
        "min_tokens": request.min_tokens,
        "logprobs": request.num_logprobs,
        "logit_bias": parse_logit_bias(request.logit_bias, vocab_size),
        "speculative": request.speculative,
        "structured_output": request.structured_output(),
    }
    kwargs.update({name: value for name, value in optional.items() if value is not None})
    if max_tokens is not None:
        kwargs["max_tokens"] = max_tokens
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        kwargs["prompt_logprobs"] = request.logprobs
    return kwargs
