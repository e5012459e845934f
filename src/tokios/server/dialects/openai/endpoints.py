"""OpenAI's chat completions, completions and embeddings, and the OpenAI-compatible servers'
utility routes (`/v1/models`, vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`).

A translation onto the shared paths like every dialect: a chat body becomes a ChatTurn
(server/generation.py) and its run is shaped as `chat.completion` or streamed
`chat.completion.chunk` events; completions and embeddings run their prompts through the same
Serving (server/serving.py), one engine request per prompt. Bodies are validated with
dialects/openai/protocol.py, answers shaped by dialects/openai/shapes.py; the `OPENAI` record at
the end names the routes, the error body and the stream framing (`data: {...}` events, then
`data: [DONE]`, also after an error event).
"""

from __future__ import annotations

import base64
import struct
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tokios.errors import InvalidRequestError
from tokios.outputs import RequestOutput
from tokios.encoder.loader import EMBEDDING, GENERATE
from tokios.server.dialects.dialect import DATA_ONLY, SSE, Dialect, Route, guarded_stream, model_route
from tokios.server.dialects.openai import shapes
from tokios.server.dialects.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                    EmbeddingRequest, TokenizeRequest, sampling_kwargs)
from tokios.server.embeddings import embed, token_inputs
from tokios.server.errors import model_not_found, openai_error_body
from tokios.server.generation import ChatRun, ChatTurn
from tokios.server.registry import ModelLease
from tokios.server.serving import Serving
from tokios.server.streams import EngineStream, Job, StreamedResponse
from tokios.tool_calls import ToolSet
from tokios.tool_calls.parser import openai_tool_call_chunks


# ---- chat ---------------------------------------------------------------------------------------

async def chat(http_request: Request, body: ChatCompletionRequest, lease: ModelLease) -> Response:
    serving = lease.serving
    model = serving.response_model_name(body.model)
    body.check_supported()
    tools = ToolSet.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
    turn = ChatTurn(body.messages_as_dicts(), sampling_kwargs(body, vocab_size=serving.vocab_size),
                    body.requested_max_tokens, tools, body.add_generation_prompt,
                    thinking=body.thinking_request(), template_kwargs=dict(body.chat_template_kwargs or {}))
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    run = await serving.start_chat(http_request, turn, lease, stream=body.stream, response_id=response_id)
    if body.stream:
        return StreamedResponse(guarded_stream(OPENAI, _chat_events(serving, body, run, response_id, model)), run.job)
    choices = []
    for result in await run.results():
        logprobs = None
        if body.logprobs:
            logprobs = shapes.chat_logprobs(result.token_ids, result.logprobs or [], body.top_logprobs or 0,
                                               serving.decode_token)
        choices.append(shapes.chat_choice(result.index, result.content, result.finish_reason, logprobs,
                                          result.tool_calls, result.reasoning))
    return JSONResponse(shapes.chat_completion(response_id, run.created, model, choices, run.num_prompt_tokens,
                                               run.num_completion_tokens, run.num_cached_prompt_tokens,
                                               _reasoning_tokens(run)))


def _reasoning_tokens(run: ChatRun) -> int | None:
    """usage's reasoning_tokens, for a model that reasons."""
    return run.num_reasoning_tokens if run.reasoning.reasoning_format is not None else None


async def _chat_events(serving: Serving, body: ChatCompletionRequest, run: ChatRun, response_id: str,
                       model: str) -> AsyncIterator[dict[str, Any]]:
    include_usage = body.include_usage_in_stream

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return shapes.chat_chunk(response_id, run.created, model, choices, include_usage=include_usage)

    yield chunk([shapes.chat_chunk_choice(index, {"role": "assistant", "content": ""}, None)
                 for index in range(body.n)])
    async for delta in run.deltas():
        logprobs = None
        if body.logprobs and delta.logprobs:
            logprobs = shapes.chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0,
                                               serving.decode_token)
        message: dict[str, Any] = {}
        if delta.reasoning:
            message.update(shapes.reasoning_fields(delta.reasoning))
        if delta.content:
            message["content"] = delta.content
        later_calls: list[list[dict[str, Any]]] = []
        if delta.tool_calls:
            message["tool_calls"], *later_calls = openai_tool_call_chunks(delta.tool_calls)
        finish_reason = None if later_calls else delta.finish_reason
        if message or finish_reason or logprobs:
            yield chunk([shapes.chat_chunk_choice(delta.index, message, finish_reason, logprobs)])
        for position, calls in enumerate(later_calls, 1):
            finish_reason = delta.finish_reason if position == len(later_calls) else None
            yield chunk([shapes.chat_chunk_choice(delta.index, {"tool_calls": calls}, finish_reason, None)])
    if include_usage:
        yield shapes.usage_chunk(response_id, run.created, model, "chat.completion.chunk", run.num_prompt_tokens,
                                 run.num_completion_tokens, run.num_cached_prompt_tokens, _reasoning_tokens(run))


# ---- completions ---------------------------------------------------------------------------------

def _completion_prompts(serving: Serving, body: CompletionRequest) -> tuple[list[str], list[list[int]]]:
    prompt_texts: list[str] = []
    prompt_ids_list: list[list[int]] = []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            prompt_ids = serving.tokenizer.encode(prompt, add_special_tokens=True)
            prompt_text = prompt
        else:
            serving.check_token_ids(prompt, "prompt")
            prompt_ids = list(prompt)
            prompt_text = serving.tokenizer.decode(prompt_ids)
        if not prompt_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        prompt_texts.append(prompt_text)
        prompt_ids_list.append(prompt_ids)
    return prompt_texts, prompt_ids_list


async def completions(http_request: Request, body: CompletionRequest, lease: ModelLease) -> Response:
    serving = lease.serving
    model = serving.response_model_name(body.model)
    body.check_supported()
    prompt_texts, prompt_ids_list = _completion_prompts(serving, body)
    max_tokens = min(serving.resolve_max_tokens(len(ids), body.requested_max_tokens, "prompt")
                     for ids in prompt_ids_list)
    # echo with max_tokens 0 (prompt scoring only) still runs one engine step to get prompt
    # logprobs; the generated token is dropped. For 0 or 1 tokens EOS must not end the request
    # early, so that exactly one token follows the prompt (lm-evaluation-harness slices [ctx:-1]).
    is_prompt_only = body.echo and max_tokens == 0
    kwargs = {**sampling_kwargs(body, vocab_size=serving.vocab_size), "max_tokens": max(1, max_tokens)}
    if body.echo and max_tokens <= 1:
        kwargs["ignore_eos"] = True
    sampling_params, kwargs = serving.sampling_params(kwargs)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    job = serving.new_job(response_id, prompt_ids_list, sampling_params, kwargs, lease)
    created = int(time.time())
    if body.stream:
        first_outputs = await serving.start_stream(http_request, job)
        events = _completion_events(serving, body, job, first_outputs, prompt_texts, response_id, created, model)
        return StreamedResponse(guarded_stream(OPENAI, events), job)
    outputs = await serving.finish(http_request, job)
    choices = []
    num_completion_tokens = 0
    for prompt_index, (stream, output) in enumerate(zip(job.streams, outputs)):
        for choice in output.outputs:
            completion_ids = [] if is_prompt_only else choice.token_ids
            completion_text = "" if is_prompt_only else choice.text
            num_completion_tokens += len(completion_ids)
            text = prompt_texts[prompt_index] + completion_text if body.echo else completion_text
            logprobs = None
            if body.logprobs is not None:
                logprobs = _completion_logprobs(serving, body, stream, output, completion_ids, choice,
                                                     prompt_texts[prompt_index])
            finish_reason = "length" if is_prompt_only else choice.finish_reason
            choices.append(shapes.completion_choice(prompt_index * body.n + choice.index, text,
                                                       finish_reason, logprobs))
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids_list)
    num_cached_prompt_tokens = sum(stream.num_cached_prompt_tokens for stream in job.streams)
    return JSONResponse(shapes.text_completion(response_id, created, model, choices, num_prompt_tokens,
                                                  num_completion_tokens, num_cached_prompt_tokens))


def _completion_logprobs(serving: Serving, body: CompletionRequest, stream: EngineStream, output: RequestOutput,
                         completion_ids: list[int], choice, prompt_text: str) -> dict[str, Any]:
    prompt_part = None
    if body.echo:
        if output.prompt_logprobs is None:
            raise InvalidRequestError("echo with logprobs needs prompt logprobs, which the engine did "
                                      "not return", param="echo")
        prompt_part = shapes.completion_logprobs(stream.prompt_ids, output.prompt_logprobs,
                                                    serving.decode_token)
    generated_logprobs = stream.logprobs_of(choice) or []
    offset = len(prompt_text) if body.echo else 0
    generated_part = shapes.completion_logprobs(completion_ids, generated_logprobs[:len(completion_ids)],
                                                   serving.decode_token, initial_text_offset=offset)
    return shapes.merge_completion_logprobs(prompt_part, generated_part)


async def _completion_events(serving: Serving, body: CompletionRequest, job: Job,
                             first_outputs: list[RequestOutput | None], prompt_texts: list[str],
                             response_id: str, created: int, model: str) -> AsyncIterator[dict[str, Any]]:
    is_echo_pending = {index: body.echo for index in range(len(job.streams) * body.n)}
    text_offsets = {index: len(prompt_texts[index // body.n]) if body.echo else 0
                    for index in is_echo_pending}

    def output_chunk(prompt_index: int, output: RequestOutput) -> dict[str, Any] | None:
        choices = []
        for choice in output.outputs:
            index = prompt_index * body.n + choice.index
            text = choice.text_delta
            if is_echo_pending[index]:
                text = prompt_texts[prompt_index] + text
                is_echo_pending[index] = False
            if not (text or choice.finish_reason or choice.logprobs_delta):
                continue
            logprobs = None
            if body.logprobs is not None and choice.logprobs_delta:
                logprobs = shapes.completion_logprobs(
                    choice.token_ids_delta, choice.logprobs_delta, serving.decode_token,
                    initial_text_offset=text_offsets[index])
                text_offsets[index] += sum(len(token) for token in logprobs["tokens"])
            choices.append(shapes.completion_choice(index, text, choice.finish_reason, logprobs))
        if not choices:
            return None
        return shapes.text_completion(response_id, created, model, choices, None, None)

    for prompt_index, output in enumerate(first_outputs):
        if output is not None and (event := output_chunk(prompt_index, output)):
            yield event
    async for prompt_index, output in job.rest():
        if event := output_chunk(prompt_index, output):
            yield event
    if body.include_usage_in_stream:
        num_prompt_tokens = sum(len(stream.prompt_ids) for stream in job.streams)
        num_completion_tokens = sum(len(choice.token_ids) for stream in job.streams
                                    for choice in stream.last_output.outputs)
        num_cached_prompt_tokens = sum(stream.num_cached_prompt_tokens for stream in job.streams)
        yield shapes.usage_chunk(response_id, created, model, "text_completion", num_prompt_tokens,
                                 num_completion_tokens, num_cached_prompt_tokens)


# ---- embeddings and utilities ------------------------------------------------------------------

async def embeddings(http_request: Request, body: EmbeddingRequest, lease: ModelLease) -> Response:
    """OpenAI's /v1/embeddings: texts or token id lists in, one vector each (float or base64)."""
    serving = lease.serving
    model = serving.response_model_name(body.model)
    prompt_ids_list = await token_inputs(serving, body.inputs(), prompt_name=body.chosen_prompt_name(),
                                         truncate=body.truncate)
    vectors = await embed(serving, http_request, prompt_ids_list, lease, dimensions=body.dimensions)
    data = []
    for index, vector in enumerate(vectors):
        encoded: Any = vector
        if body.encoding_format == "base64":  # float32 little-endian, as OpenAI's
            encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
        data.append({"object": "embedding", "index": index, "embedding": encoded})
    num_tokens = sum(len(ids) for ids in prompt_ids_list)
    return JSONResponse({"object": "list", "data": data, "model": model,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def tokenize(serving: Serving, body: TokenizeRequest) -> dict[str, Any]:
    body.check_supported()
    if body.messages is not None:
        text = serving.tokenizer.apply_chat_template(
            [{"role": message.role, "content": message.text()} for message in body.messages],
            add_generation_prompt=body.add_generation_prompt)
        token_ids = serving.tokenizer.encode(text, add_special_tokens=False)
    else:
        token_ids = serving.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    return {"tokens": token_ids, "count": len(token_ids), "max_model_len": serving.max_model_len}


def tokenizer_info(serving: Serving) -> dict[str, Any]:
    """What a remote tokenizer needs (lm-evaluation-harness's `tokenizer_backend=remote`, as
    vLLM serves it): the special tokens, the chat template and the context length; encoding
    and decoding go through /tokenize and /detokenize."""
    tokenizer = serving.tokenizer
    return {"model": serving.model_name, "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token": None, "chat_template": tokenizer.chat_template,
            "model_max_length": serving.max_model_len, "vocab_size": serving.vocab_size}


def detokenize(serving: Serving, body: DetokenizeRequest) -> dict[str, Any]:
    serving.check_token_ids(body.tokens, "tokens")
    return {"prompt": serving.tokenizer.decode(body.tokens)}


# ---- routes -------------------------------------------------------------------------------------

async def _models_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()
    return JSONResponse({"object": "list", "data": state.registry.model_cards(state.created)})


async def _model_route(request: Request) -> Response:
    """One model's card, as OpenAI's GET /v1/models/{model} (`client.models.retrieve`). The id
    is the name the model is served under (an alias answers with its own id); an unknown one is a
    404 naming the served models."""
    state = request.app.state.tokios
    state.check_ready()
    name = request.path_params["model"]
    if not name:
        raise model_not_found(name, state.registry.names)
    entry = state.registry.entry(name)  # also takes an Ollama-style "NAME:latest", as every route does
    served_name = name if name in entry.spec.names else name.removesuffix(":latest")
    return JSONResponse(state.registry.model_card(entry, served_name, state.created))


async def _tokenize_answer(request: Request, body: TokenizeRequest, lease: ModelLease) -> Response:
    return JSONResponse(tokenize(lease.serving, body))


async def _detokenize_answer(request: Request, body: DetokenizeRequest, lease: ModelLease) -> Response:
    return JSONResponse(detokenize(lease.serving, body))


async def _tokenizer_info_route(request: Request) -> Response:
    state = request.app.state.tokios
    state.check_ready()

    async def run(lease: ModelLease) -> Response:
        return JSONResponse(tokenizer_info(lease.serving))
    return await state.respond(request.query_params.get("model"), run)


_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": {"type": "string"},
                "description": "which model (default: the first)"}


OPENAI = Dialect(
    name="openai",
    routes=(
        Route("post", "/v1/chat/completions",
              model_route(ChatCompletionRequest, chat, GENERATE, uses_chat_template=True), "Chat completion (OpenAI)",
              ChatCompletionRequest, shapes.ChatCompletion, SSE, shapes.ChatCompletionChunk, generates=True),
        Route("post", "/v1/completions", model_route(CompletionRequest, completions, GENERATE), "Text completion (OpenAI)",
              CompletionRequest, shapes.TextCompletion, SSE, shapes.TextCompletion, generates=True),
        Route("post", "/v1/embeddings", model_route(EmbeddingRequest, embeddings, EMBEDDING),
              "Embeddings (OpenAI): pooled, normalized final hidden states", EmbeddingRequest, shapes.EmbeddingList,
              generates=True),
        Route("get", "/v1/models", _models_route, "Served models", answer=shapes.ModelList),
        Route("get", "/v1/models/{model:path}", _model_route, "One served model", answer=shapes.ModelCard,
              parameters=({"name": "model", "in": "path", "required": True, "schema": {"type": "string"},
                           "description": "a served model's id (names with a '/' included)"},)),
        Route("post", "/tokenize", model_route(TokenizeRequest, _tokenize_answer), "Text or messages to token ids",
              TokenizeRequest, shapes.TokenizeResponse),
        Route("post", "/detokenize", model_route(DetokenizeRequest, _detokenize_answer), "Token ids to text",
              DetokenizeRequest, shapes.DetokenizeResponse),
        Route("get", "/tokenizer_info", _tokenizer_info_route,
              "Special tokens, chat template and context length (a remote tokenizer's view, as vLLM serves it)",
              answer=shapes.TokenizerInfo, parameters=(_MODEL_QUERY,)),
    ),
    # Every other path answers errors in OpenAI's shape too (errors.py's default).
    path_prefixes=(),
    error_body=openai_error_body,
    error_schema={"$ref": "#/components/schemas/ErrorResponse"},
    frame_style=DATA_ONLY,
    stream_error=openai_error_body,
    done_marker=shapes.SSE_DONE,
)
