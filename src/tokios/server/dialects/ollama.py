"""Ollama's API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version.

A thin translation onto the shared chat path (server/generation.py): `options` become
SamplingParams keyword arguments (`options_to_sampling`), `format` a structured output (its
objects closed as tool parameters are), `tools` a ToolSet, `think` a ThinkingRequest (a
reasoning model's thinking comes back as `thinking`, and prior assistant messages' `thinking`
goes to the template), `keep_alive` the model's idle lifetime in the registry. Answers are
Ollama's: NDJSON streams (`stream` defaults to true) whose last line has `done: true`, the done
reason and the counts and nanosecond durations Ollama reports; errors are `{"error": "..."}`, in
a stream as its last line (the `OLLAMA` record at the end).

Options that would change the output and that Tokios cannot honour (mirostat, tfs_z,
typical_p, repeat_last_n other than -1, per-request hardware settings) are a 400 naming the
option, never ignored. `num_ctx` above the loaded context is a 400 too (the context is fixed when
the model loads); below it, it caps this request's prompt + output.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from functools import lru_cache
from typing import Any

from pydantic import ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokios import __version__
from tokios.config import parse_duration
from tokios.encoder.loader import EMBEDDING, GENERATE
from tokios.errors import InvalidRequestError, TokiosError
from tokios.reasoning import ThinkingRequest, detect_reasoning_format
from tokios.server.body import MAX_TOP_LOGPROBS, JsonBool, JsonFloat, RequestBody, ResponseBody, parse_body
from tokios.server.embeddings import embed, token_inputs
from tokios.server.dialects.dialect import JSON_LINES, NDJSON, Dialect, Route, guarded_stream
from tokios.server.generation import ChatRun, ChatTurn
from tokios.server.logprobs import MIN_LOGPROB, finite_logprob, top_ranked
from tokios.server.registry import LOADED, ModelEntry, ModelLease
from tokios.server.serving import make_sampling_params
from tokios.server.streams import StreamedResponse
from tokios.structured.spec import StructuredOutput
from tokios.tool_calls import ToolSet
from tokios.tool_calls.definitions import closed_objects

# options -> SamplingParams names; the values keep their meaning.
_OPTION_TO_SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "seed": "seed", "repeat_penalty": "repetition_penalty",
                       "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
# Options whose effect Tokios does not implement: refused rather than ignored. The value that
# means "off" is accepted.
_UNSUPPORTED_OPTIONS = {"mirostat": 0, "mirostat_eta": None, "mirostat_tau": None, "tfs_z": 1.0, "typical_p": 1.0,
                        "penalize_newline": None, "num_keep": None}
# Load-time settings: Tokios takes them as `tokios serve` flags, not per request.
_LOAD_TIME_OPTIONS = ("num_gpu", "main_gpu", "num_thread", "num_batch", "use_mmap", "use_mlock", "numa", "low_vram",
                      "vocab_only", "f16_kv", "logits_all")
_KNOWN_OPTIONS = set(_OPTION_TO_SAMPLING) | set(_UNSUPPORTED_OPTIONS) | set(_LOAD_TIME_OPTIONS) | {
    "num_predict", "stop", "num_ctx", "repeat_last_n", "ignore_eos"}

# GGUF general.file_type -> Ollama's quantization_level names.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


# What the handlers refuse, published in the schema as well (their own messages name the field):
# a value that must be empty or absent, the message roles and the keep-alive forms.
_EMPTY_ONLY = {"maxLength": 0, "maxItems": 0, "description": "not supported: a non-empty value is a 400"}
_DURATION = {"anyOf": [{"type": "string", "pattern": r"^\s*[+-]*( *[0-9]*\.?[0-9]+ *(ms|h|m|s)?)+ *\s*$"},
                       {"type": "number"}, {"type": "null"}],
             "description": "a duration like 5m, 1h30m or 250ms, or a number of seconds; negative: forever"}
_THINK_EFFORTS = ("low", "medium", "high")
_THINK = {"anyOf": [{"type": "boolean"}, {"enum": list(_THINK_EFFORTS)}, {"type": "null"}],
          "description": "a reasoning model's thinking: on, off, or on with an effort (its thinking budget)"}


def _options_schema() -> dict[str, Any]:
    """`options` as the handler takes them: known names only, each with its type and range."""
    number = {"type": "number"}
    properties: dict[str, Any] = {
        "temperature": {**number, "minimum": 0}, "top_p": {**number, "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": -1}, "min_p": {**number, "minimum": 0, "maximum": 1},
        "seed": {"type": "integer"}, "repeat_penalty": {**number, "exclusiveMinimum": 0},
        "frequency_penalty": {**number, "minimum": -2, "maximum": 2},
        "presence_penalty": {**number, "minimum": -2, "maximum": 2},
        "num_predict": {"type": "integer"}, "num_ctx": {"type": "integer", "minimum": 1},
        "stop": {"anyOf": [{"type": "string", "minLength": 1},
                           {"type": "array", "items": {"type": "string", "minLength": 1}}]},
        "repeat_last_n": {"enum": [-1, None]}, "ignore_eos": {"type": "boolean"},
    }
    for name, off_value in _UNSUPPORTED_OPTIONS.items():
        properties[name] = {"enum": [None] if off_value is None else [off_value, None]}
    # A null option is left unset, as Ollama does.
    properties = {name: {"anyOf": [schema, {"type": "null"}]} for name, schema in properties.items()}
    return {"anyOf": [{"type": "object", "properties": properties, "additionalProperties": False},
                      {"type": "null"}]}


class OllamaMessage(RequestBody):
    role: str = Field(json_schema_extra={"enum": ["system", "user", "assistant", "tool"]})
    content: str | None = None
    images: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY_ONLY)
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _OllamaBody(RequestBody):
    model: str = Field(min_length=1)
    format: str | dict[str, Any] | None = Field(default=None, json_schema_extra={
        "anyOf": [{"enum": ["", "json"]}, {"type": "object"}, {"type": "null"}]})
    options: dict[str, Any] | None = Field(default=None, json_schema_extra=_options_schema())
    stream: JsonBool = True
    keep_alive: str | JsonFloat | None = Field(default=None, json_schema_extra=_DURATION)
    think: JsonBool | str | None = Field(default=None, json_schema_extra=_THINK)
    logprobs: JsonBool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class OllamaChatRequest(_OllamaBody):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[Any] | None = None


class OllamaGenerateRequest(_OllamaBody):
    prompt: str = ""
    suffix: str | None = Field(default=None, json_schema_extra=_EMPTY_ONLY)
    system: str | None = None
    template: str | None = Field(default=None, json_schema_extra=_EMPTY_ONLY)
    context: list[int] | None = Field(default=None, json_schema_extra=_EMPTY_ONLY)
    raw: JsonBool = False
    images: list[Any] | None = Field(default=None, json_schema_extra=_EMPTY_ONLY)


class OllamaEmbedRequest(RequestBody):
    model: str = Field(min_length=1)
    input: str | list[str] = Field(json_schema_extra={"minLength": 1, "minItems": 1,
                                                      "items": {"type": "string", "minLength": 1}})
    truncate: JsonBool = True
    options: dict[str, Any] | None = Field(default=None, json_schema_extra={
        "description": "only load-time options; a sampling option is a 400"})
    keep_alive: str | JsonFloat | None = Field(default=None, json_schema_extra=_DURATION)
    dimensions: int | None = Field(default=None, ge=1)


class OllamaEmbeddingsRequest(RequestBody):
    """The older /api/embeddings: one prompt, one vector."""

    model: str = Field(min_length=1)
    # An empty prompt has no tokens to pool with most tokenizers (a 400 then).
    prompt: str = Field(json_schema_extra={"minLength": 1})
    options: dict[str, Any] | None = None
    keep_alive: str | JsonFloat | None = Field(default=None, json_schema_extra=_DURATION)


class OllamaModelRequest(RequestBody):
    # One of the two names the model (older clients send `name`).
    model_config = ConfigDict(extra="ignore", json_schema_extra={
        "anyOf": [{"required": ["model"], "properties": {"model": {"type": "string"}}},
                  {"required": ["name"], "properties": {"name": {"type": "string"}}}]})

    model: str | None = None
    name: str | None = None
    verbose: JsonBool = False


_FAR_FUTURE = 4102444800.0  # 2100-01-01, what Ollama shows for "never"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def options_to_sampling(options: dict[str, Any] | None, max_model_len: int) -> tuple[dict[str, Any], int | None,
                                                                                      int | None]:
    """(SamplingParams kwargs, num_predict or None, num_ctx or None) of Ollama's `options`."""
    options = options or {}
    if not isinstance(options, dict):
        raise InvalidRequestError("options must be an object", param="options")
    kwargs: dict[str, Any] = {}
    for name, value in options.items():
        where = f"options.{name}"
        if name not in _KNOWN_OPTIONS:
            raise InvalidRequestError(f"{where} is not an option Tokios knows", param=where)
        if name in _LOAD_TIME_OPTIONS:
            raise InvalidRequestError(f"{where} is a load-time setting; Tokios takes it from `tokios serve` flags, "
                                      "not per request", param=where)
        if name in _UNSUPPORTED_OPTIONS:
            if value is None or value == _UNSUPPORTED_OPTIONS[name]:
                continue
            raise InvalidRequestError(f"{where} is not supported by Tokios's sampler", param=where)
        if name == "repeat_last_n":
            if value not in (-1, None):
                raise InvalidRequestError(f"{where}: Tokios's repeat penalty covers the whole context; only -1 "
                                          "(the whole context) is supported", param=where)
            continue
        if name in _OPTION_TO_SAMPLING and value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InvalidRequestError(f"{where} must be a number", param=where)
            kwargs[_OPTION_TO_SAMPLING[name]] = value
    ignore_eos = options.get("ignore_eos")  # an extension (as on the OpenAI routes): benchmarks need fixed lengths
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise InvalidRequestError("options.ignore_eos must be true or false", param="options.ignore_eos")
        kwargs["ignore_eos"] = ignore_eos
    stop = options.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(text, str) and text for text in stop):
            raise InvalidRequestError("options.stop must be a list of non-empty strings", param="options.stop")
        kwargs["stop"] = stop
    num_predict = _int_option(options, "num_predict")
    if num_predict is not None and num_predict < 0:  # -1: until the context is full; -2: the same here
        num_predict = None
    num_ctx = _int_option(options, "num_ctx")
    if num_ctx is not None:
        if num_ctx < 1:
            raise InvalidRequestError("options.num_ctx must be >= 1", param="options.num_ctx")
        if num_ctx > max_model_len:
            raise InvalidRequestError(f"options.num_ctx {num_ctx} exceeds the model's loaded context of "
                                      f"{max_model_len} tokens (tokios serve --max-model-len)", param="options.num_ctx")
    return kwargs, num_predict, num_ctx


def _int_option(options: dict[str, Any], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"options.{name} must be an integer", param=f"options.{name}")
    return value


def _format(value: str | dict[str, Any] | None) -> StructuredOutput | None:
    if value is None or value == "":
        return None
    if value == "json":
        return StructuredOutput.from_structured_outputs({"json_object": True})
    if isinstance(value, dict):
        # Closed as tool parameters are, and as Ollama's own converter (llama.cpp's
        # json-schema-to-grammar) closes them: an object listing its properties admits no others
        # unless the schema says so, so a reply parses into the caller's model class.
        return StructuredOutput.from_structured_outputs({"json": closed_objects(value)}, param="format")
    raise InvalidRequestError(f"format must be \"json\" or a JSON schema, got {value!r}", param="format")


def _keep_alive(value: str | float | None) -> float | None:
    return None if value is None else parse_duration(value, field_name="keep_alive")


def _thinking(body: _OllamaBody) -> ThinkingRequest:
    """`think`: true or false, or an effort (Ollama's levels, for models such as gpt-oss)."""
    think = body.think
    if think is None:
        return ThinkingRequest(param="think")
    if isinstance(think, bool):
        return ThinkingRequest(think, param="think")
    if think not in _THINK_EFFORTS:
        raise InvalidRequestError(f"think must be true, false or one of {list(_THINK_EFFORTS)}, got {think!r}",
                                  param="think")
    return ThinkingRequest(True, think, param="think")


def _common_sampling(body: _OllamaBody, max_model_len: int) -> tuple[dict[str, Any], int | None, int | None]:
    _thinking(body)
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    kwargs, num_predict, num_ctx = options_to_sampling(body.options, max_model_len)
    structured_output = _format(body.format)
    if structured_output is not None:
        kwargs["structured_output"] = structured_output
    if body.logprobs:
        kwargs["logprobs"] = body.top_logprobs or 0
    return kwargs, num_predict, num_ctx


def _messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    """Ollama messages -> the OpenAI-shaped messages of a ChatTurn."""
    converted = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if message.role not in ("system", "user", "assistant", "tool"):
            raise InvalidRequestError(f"{where}.role must be system, user, assistant or tool, got {message.role!r}",
                                      param=f"{where}.role")
        if message.images:
            raise InvalidRequestError(f"{where}.images: this model takes no images", param=f"{where}.images")
        entry: dict[str, Any] = {"role": message.role, "content": message.content or ""}
        if message.thinking and message.role == "assistant":  # the template keeps or drops it
            entry["reasoning_content"] = message.thinking
        if message.tool_calls:
            calls = []
            for call_index, call in enumerate(message.tool_calls):
                function = call.get("function") if isinstance(call, dict) else None
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    raise InvalidRequestError(f"{where}.tool_calls[{call_index}] must be {{'function': {{'name', "
                                              "'arguments'}}}", param=f"{where}.tool_calls")
                calls.append({"id": call.get("id") or f"call_{index}_{call_index}", "type": "function",
                              "function": {"name": function["name"], "arguments": function.get("arguments") or {}}})
            entry["tool_calls"] = calls
        converted.append(entry)
    return converted


def _logprobs(run: ChatRun, token_ids: list[int], positions, num_top: int) -> list[dict[str, Any]]:
    decode = run.serving.decode_token
    entries = []
    for token_id, position in zip(token_ids, positions or []):
        sampled = position.get(token_id)
        entries.append({"token": decode(token_id, sampled),
                        "logprob": finite_logprob(sampled.logprob) if sampled else MIN_LOGPROB,
                        "top_logprobs": [{"token": decode(top_id, entry), "logprob": finite_logprob(entry.logprob)}
                                         for top_id, entry in top_ranked(position, num_top)]})
    return entries


def _done_fields(run: ChatRun, done_reason: str | None) -> dict[str, Any]:
    return {"done": True, "done_reason": done_reason, **run.durations_ns(),
            # As Ollama counts it: the prompt tokens evaluated, not those its cache already held.
            "prompt_eval_count": run.num_prompt_tokens - run.num_cached_prompt_tokens,
            "eval_count": run.num_completion_tokens}


def _done_reason(finish_reason: str | None) -> str | None:
    return {"length": "length", "stop": "stop", "tool_calls": "stop", "abort": "abort"}.get(finish_reason or "",
                                                                                           finish_reason)


def _ollama_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI message calls -> Ollama's, whose arguments are an object."""
    ollama_calls = []
    for call in calls:
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except ValueError:  # a call cut short by the length limit: its text, as Ollama would show
            arguments = {"_incomplete": arguments}
        ollama_calls.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
    return ollama_calls


async def _respond(http_request: Request, lease: ModelLease, turn: ChatTurn, body: _OllamaBody, *, is_chat: bool,
                   num_predict: int | None, num_ctx: int | None) -> Response:
    serving = lease.serving
    turn.requested_max_tokens, turn.context_limit = num_predict, num_ctx
    model = body.model
    num_top = body.top_logprobs or 0
    run = await serving.start_chat(http_request, turn, lease, stream=body.stream,
                                   response_id=f"ollama-{uuid.uuid4().hex}")

    def piece(text: str, calls: list[dict[str, Any]] | None = None, thinking: str = "") -> dict[str, Any]:
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"message": message}
        return {"response": text, "thinking": thinking} if thinking else {"response": text}

    if not body.stream:
        result = (await run.results())[0]
        payload = {"model": model, "created_at": _now(),
                   **piece(result.content or "", _ollama_calls(result.tool_calls), result.reasoning or ""),
                   **_done_fields(run, _done_reason(result.finish_reason))}
        if body.logprobs:
            payload["logprobs"] = _logprobs(run, result.token_ids, result.logprobs, num_top)
        return JSONResponse(payload)

    async def lines() -> AsyncIterator[dict[str, Any]]:
        calls: dict[int, dict[str, Any]] = {}
        finish_reason = None
        async for delta in run.deltas():
            for call in delta.tool_calls:  # Ollama sends each call whole: collect the fragments
                entry = calls.setdefault(call.index, {"function": {"name": call.name, "arguments": ""}})
                entry["function"]["arguments"] += call.arguments
            if delta.content or delta.reasoning or delta.token_ids:
                line = {"model": model, "created_at": _now(), **piece(delta.content, thinking=delta.reasoning),
                        "done": False}
                if body.logprobs and delta.logprobs:
                    line["logprobs"] = _logprobs(run, delta.token_ids, delta.logprobs, num_top)
                if delta.content or delta.reasoning or body.logprobs:
                    yield line
            finish_reason = delta.finish_reason or finish_reason
        if calls:
            whole = [{"function": call["function"]} for _, call in sorted(calls.items())]
            yield {"model": model, "created_at": _now(), **piece("", _ollama_calls(whole)), "done": False}
        yield {"model": model, "created_at": _now(), **piece(""), **_done_fields(run, _done_reason(finish_reason))}

    return StreamedResponse(guarded_stream(OLLAMA, lines()), run.job, media_type=NDJSON)


# ---- model information --------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _file_facts(path: str) -> dict[str, Any]:
    """What /api/tags, /api/show and /api/ps say about a model file: details, size, metadata."""
    from tokios.gguf_file import read_gguf_metadata
    from tokios.model.shape import read_model_shape

    facts: dict[str, Any] = {"size": 0, "modified_at": _now(), "metadata": {}, "details": {
        "parent_model": "", "format": "gguf" if path.endswith(".gguf") else "safetensors", "family": "",
        "families": [], "parameter_size": "", "quantization_level": ""}}
    if not path or not os.path.exists(path):
        return facts
    if os.path.isdir(path):
        facts["size"] = sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    else:
        facts["size"] = os.path.getsize(path)
    facts["modified_at"] = _iso(os.path.getmtime(path))
    details = facts["details"]
    try:
        shape = read_model_shape(path)
    except Exception:  # unreadable files fail when they load; the listing stays up
        return facts
    num_params = shape.num_params if hasattr(shape, "num_params") else None
    if path.endswith(".gguf"):
        metadata = read_gguf_metadata(path)
        facts["metadata"] = metadata
        architecture = str(metadata.get("general.architecture", ""))
        details.update(family=architecture, families=[architecture] if architecture else [],
                       quantization_level=_FILE_TYPES.get(metadata.get("general.file_type"), ""))
        num_params = num_params or metadata.get("general.parameter_count")
    if num_params:
        details["parameter_size"] = _parameter_size(num_params)
    facts["context_length"] = shape.max_context_len
    return facts


def _parameter_size(num_params: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_params >= scale:
            return f"{num_params / scale:.1f}".rstrip("0").rstrip(".") + suffix
    return str(int(num_params))


def _model_summary(entry: ModelEntry, name: str) -> dict[str, Any]:
    facts = _file_facts(entry.spec.path)
    return {"name": name, "model": name, "modified_at": facts["modified_at"], "size": facts["size"],
            "digest": "", "details": facts["details"]}


def _model_info(metadata: dict[str, Any], verbose: bool) -> dict[str, Any]:
    """GGUF metadata as Ollama shows it: scalars, and long arrays only when verbose."""
    info = {}
    for key, value in metadata.items():
        if key == "tokenizer.chat_template":
            continue
        if isinstance(value, list) and len(value) > 16 and not verbose:
            info[key] = None
        else:
            info[key] = value.tolist() if hasattr(value, "tolist") else value
    return info


async def _chat_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    body = await parse_body(request, OllamaChatRequest)
    keep_alive_s = _keep_alive(body.keep_alive)
    # What can be checked without the model is checked first: a request that only loads the model
    # still refuses a bad option (the context limit waits for the model).
    make_sampling_params({**_common_sampling(body, max_model_len=sys.maxsize)[0], "max_tokens": 1})
    if not body.messages:  # Ollama: an empty chat loads (or, with keep_alive 0, unloads) the model
        return await _load_or_unload(state, body.model, keep_alive_s, {"message": {"role": "assistant", "content": ""}})

    async def run(lease: ModelLease) -> Response:
        serving = lease.serving
        sampling, num_predict, num_ctx = _common_sampling(body, serving.max_model_len)
        tools = ToolSet.from_request(body.tools, "auto" if body.tools else None, True)
        turn = ChatTurn(_messages(body.messages), sampling, None, tools, thinking=_thinking(body))
        make_sampling_params({**sampling, "max_tokens": 1})  # bad values are a 400 before the prompt is built
        return await _respond(request, lease, turn, body, is_chat=True, num_predict=num_predict, num_ctx=num_ctx)
    return await state.respond(body.model, run, keep_alive_s, needs=GENERATE)


async def _generate_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    body = await parse_body(request, OllamaGenerateRequest)
    keep_alive_s = _keep_alive(body.keep_alive)
    for name in ("suffix", "template", "context", "images"):
        if getattr(body, name):
            raise InvalidRequestError(f"{name} is not supported by this server", param=name)
    make_sampling_params({**_common_sampling(body, max_model_len=sys.maxsize)[0], "max_tokens": 1})
    if not body.prompt:
        return await _load_or_unload(state, body.model, keep_alive_s, {"response": ""})

    async def run(lease: ModelLease) -> Response:
        serving = lease.serving
        sampling, num_predict, num_ctx = _common_sampling(body, serving.max_model_len)
        make_sampling_params({**sampling, "max_tokens": 1})
        # Without raw, the prompt goes through the model's template as a user turn (Ollama);
        # a model without a template (a pretrained one) continues the text as it is.
        if body.raw or not serving.tokenizer.chat_template:
            if body.think not in (None, False):
                raise InvalidRequestError("think: a raw prompt (or a model without a chat template) bypasses the "
                                          "template, so nothing would turn the thinking on", param="think")
            text = body.prompt if not body.system else f"{body.system}\n\n{body.prompt}"
            turn = ChatTurn([], sampling, raw_prompt=text)
        else:
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}]
            turn = ChatTurn(messages, sampling, thinking=_thinking(body))
        return await _respond(request, lease, turn, body, is_chat=False, num_predict=num_predict, num_ctx=num_ctx)
    return await state.respond(body.model, run, keep_alive_s, needs=GENERATE)


async def _load_or_unload(state, model: str, keep_alive_s: float | None, piece: dict[str, Any]) -> Response:
    if keep_alive_s == 0:
        entry = state.registry.entry(model)
        await state.registry.unload(entry)
        return JSONResponse({"model": model, "created_at": _now(), **piece, "done": True, "done_reason": "unload"})
    lease = await state.acquire(model, keep_alive_s)
    lease.release()
    return JSONResponse({"model": model, "created_at": _now(), **piece, "done": True, "done_reason": "load",
                         "load_duration": int(lease.load_seconds * 1e9)})


async def _embed_texts(request: Request, lease: ModelLease, texts: list[str], truncate: bool,
                       options: dict[str, Any] | None, dimensions: int | None = None,
                       param: str = "input") -> tuple[list[list[float]], int]:
    serving = lease.serving
    if options:
        sampling, _, _ = options_to_sampling(options, serving.max_model_len)
        if sampling:
            raise InvalidRequestError(f"options: {sorted(sampling)} do not apply to embeddings", param="options")
    serving.embedding.check_dimensions(dimensions)  # before the texts are tokenized
    prompt_ids_list = await token_inputs(serving, texts, prompt_name=None, truncate=truncate, param=param)
    vectors = await embed(serving, request, prompt_ids_list, lease, dimensions=dimensions, param=param)
    return vectors, sum(len(ids) for ids in prompt_ids_list)


async def _embed_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    body = await parse_body(request, OllamaEmbedRequest)
    texts = [body.input] if isinstance(body.input, str) else body.input
    if not texts:
        raise InvalidRequestError("input must not be empty", param="input")

    async def run(lease: ModelLease) -> Response:
        started = time.monotonic()
        vectors, num_tokens = await _embed_texts(request, lease, texts, body.truncate, body.options, body.dimensions)
        return JSONResponse({"model": body.model, "embeddings": vectors,
                             "total_duration": int((time.monotonic() - started + lease.load_seconds) * 1e9),
                             "load_duration": int(lease.load_seconds * 1e9), "prompt_eval_count": num_tokens})
    return await state.respond(body.model, run, _keep_alive(body.keep_alive), needs=EMBEDDING)


async def _embeddings_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    body = await parse_body(request, OllamaEmbeddingsRequest)

    async def run(lease: ModelLease) -> Response:
        vectors, _ = await _embed_texts(request, lease, [body.prompt], True, body.options, param="prompt")
        return JSONResponse({"embedding": vectors[0]})
    return await state.respond(body.model, run, _keep_alive(body.keep_alive), needs=EMBEDDING)


async def _tags_route(request: Request) -> Response:
    state = request.app.state.tokios
    return JSONResponse({"models": [_model_summary(entry, name) for entry in state.registry.entries
                                    for name in entry.spec.names]})


async def _show_route(request: Request) -> Response:
    state = request.app.state.tokios
    body = await parse_body(request, OllamaModelRequest)
    name = body.model or body.name
    if not name:
        raise InvalidRequestError("model is required", param="model")
    entry = state.registry.entry(name)
    facts = _file_facts(entry.spec.path)
    metadata = facts["metadata"]
    template = metadata.get("tokenizer.chat_template") or ""
    if entry.spec.kind != GENERATE:  # an embedding model or a cross-encoder generates nothing
        capabilities = ["embedding"] if entry.spec.kind == EMBEDDING else []
    else:
        capabilities = ["completion", "embedding"] + (["tools"] if template else [])
        # "thinking" (Ollama's word for a model that reasons): the loaded model's format (its chat
        # template may be another file's, its format set by a flag), or the one its file implies.
        if entry.serving is not None:
            thinks = entry.serving.reasoning_format is not None
        else:
            thinks = detect_reasoning_format(template, frozenset()) is not None
        if thinks:
            capabilities.append("thinking")
    return JSONResponse({"license": str(metadata.get("general.license", "")), "modelfile": "",
                         "parameters": entry.spec.sampling_defaults.ollama_parameters() if entry.spec.kind == GENERATE
                         else "", "template": template, "details": facts["details"],
                         "model_info": _model_info(metadata, body.verbose), "capabilities": capabilities,
                         "modified_at": facts["modified_at"]})


async def _ps_route(request: Request) -> Response:
    state = request.app.state.tokios
    models = []
    for entry in state.registry.entries:
        if entry.state != LOADED:
            continue
        expires_at = state.registry.expires_at(entry)
        # Ollama reports a far-future time for a model that never unloads (or is in use); a
        # keep_alive of centuries is shown as that time too (datetime cannot go past year 9999).
        until = _FAR_FUTURE if expires_at is None else min(time.time() + (expires_at - time.monotonic()), _FAR_FUTURE)
        models.append({**_model_summary(entry, entry.name), "expires_at": _iso(until),
                       "size_vram": 0, "context_length": entry.serving.max_model_len})
    return JSONResponse({"models": models})


async def _version_route(request: Request) -> Response:
    return JSONResponse({"version": __version__})


def error_body(error: TokiosError) -> dict[str, Any]:
    return {"error": error.message}


class ChatLine(ResponseBody):
    """A chat answer, or one line of its NDJSON stream (the last with done: true and the counts)."""

    model: str
    created_at: str
    message: dict[str, Any]
    done: bool
    done_reason: str | None = None


class GenerateLine(ResponseBody):
    """A generate answer, or one line of its NDJSON stream."""

    model: str
    created_at: str
    response: str
    thinking: str | None = None
    done: bool
    done_reason: str | None = None


class EmbedAnswer(ResponseBody):
    model: str
    embeddings: list[list[float]]
    prompt_eval_count: int


class EmbeddingAnswer(ResponseBody):
    embedding: list[float]


class ModelListing(ResponseBody):
    models: list[dict[str, Any]]


class ModelDetails(ResponseBody):
    details: dict[str, Any]
    model_info: dict[str, Any]
    capabilities: list[str]
    template: str


class Version(ResponseBody):
    version: str


OLLAMA = Dialect(
    name="ollama",
    routes=(
        Route("post", "/api/chat", _chat_route, "Chat (Ollama): NDJSON stream by default", OllamaChatRequest,
              ChatLine, NDJSON, ChatLine, generates=True),
        Route("post", "/api/generate", _generate_route, "Generate (Ollama): NDJSON stream by default",
              OllamaGenerateRequest, GenerateLine, NDJSON, GenerateLine, generates=True),
        Route("post", "/api/embed", _embed_route, "Embeddings: pooled, normalized final hidden states (Ollama)",
              OllamaEmbedRequest, EmbedAnswer, generates=True),
        Route("post", "/api/embeddings", _embeddings_route, "One prompt's embedding (Ollama's older route)",
              OllamaEmbeddingsRequest, EmbeddingAnswer, generates=True),
        Route("get", "/api/tags", _tags_route, "Every model this server can serve (Ollama)", answer=ModelListing),
        Route("post", "/api/show", _show_route, "One model's details, metadata and capabilities (Ollama)",
              OllamaModelRequest, ModelDetails),
        Route("get", "/api/ps", _ps_route, "Loaded models and when they unload (Ollama)", answer=ModelListing),
        Route("get", "/api/version", _version_route, "Server version (Ollama)", answer=Version),
    ),
    # Unknown routes under /api/ answer in Ollama's shape too.
    path_prefixes=("/api/",),
    error_body=error_body,
    error_schema={"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    frame_style=JSON_LINES,
    stream_error=error_body,
)
