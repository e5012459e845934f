"""The OpenAI endpoints' logic: prompt -> token ids -> SamplingParams -> engine -> response.

Owns what happens between a validated request body (server/protocol.py) and the answer: the
chat template and tokenization (via engine.tokenizer), the context-length check with OpenAI's
message, admission (server/admission.py), running the engine streams (server/streams.py) with
disconnect watching, and shaping the result (server/responses.py) as JSON or as an SSE stream
whose error after the first byte is an error event followed by `[DONE]`. server/app.py routes
HTTP requests here.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tokios.errors import ContextLengthExceededError, InvalidRequestError
from tokios.outputs import Logprob, RequestOutput
from tokios.server import responses
from tokios.server.admission import Admission
from tokios.server.errors import error_payload
from tokios.server.metrics import ServerMetrics
from tokios.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                    EmbeddingRequest, TokenizeRequest, sampling_kwargs)
from tokios.server.generation import ChatRun, ChatTurn
from tokios.server.registry import ModelLease
from tokios.server.streams import EngineStream, Job, run_watching_disconnect
from tokios.tool_calls import ToolSet
from tokios.tool_calls.grammar import tool_call_grammar


@dataclass
class ServerSettings:
    served_model_names: list[str] | None = None
    max_num_seqs: int = 64
    max_queued_requests: int = 1024
    max_body_size: int = 8 * 1024**2
    shutdown_timeout_s: float = 30.0
    protect_metrics: bool = False
    log_requests: bool = True
    retry_after_s: float = 1.0
    # /health answers 503 when requests wait and the step loop has not advanced for this long.
    stall_timeout_s: float = 60.0
    # GET /health?generate=1: the deadline of its one-token generation.
    health_generate_timeout_s: float = 10.0
    # A request body must fully arrive within this long (server/connection_limits.py).
    request_body_timeout_s: float = 30.0
    # How /v1/embeddings and /api/embed pool a prompt's final hidden states: "mean" or "last".
    pooling: str = "mean"
    # The OpenAI Responses API's store (previous_response_id, GET /v1/responses/{id}).
    responses_store_size: int = 1000
    responses_store_ttl_s: float = 3600.0


def make_sampling_params(kwargs: dict[str, Any]):
    """SamplingParams from protocol.sampling_kwargs; its ValueErrors become 400s naming the field."""
    from tokios.sampling_params import SamplingParams

    field_names = {field.name for field in dataclasses.fields(SamplingParams)}
    # `speculative` ({method, num_tokens}) is a SamplingParams field; the filter only matters for
    # an older SamplingParams without it (the answer is the same with or without speculation).
    kwargs = {name: value for name, value in kwargs.items() if name in field_names or name != "speculative"}
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0].strip(":,")
        raise InvalidRequestError(message, param=first_word if first_word in kwargs else None) from exc


async def guarded_sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """SSE frames of `events`, then `data: [DONE]`; an error once the stream has started (headers
    are gone, so no status can tell it) becomes an error event in OpenAI's shape before [DONE]."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        yield responses.sse_event(error_payload(exc)[1])
    finally:
        await events.aclose()
    yield responses.SSE_DONE


class SSEResponse(StreamingResponse):
    """A stream (SSE, or Ollama's NDJSON) that always closes its job (aborting engine work and
    releasing its model), even if never iterated."""

    def __init__(self, content: AsyncIterator[str], job: Job, media_type: str = "text/event-stream"):
        super().__init__(content, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self._job.close()


class Serving:
    """One loaded model's endpoints (server/registry.py makes one per loaded engine)."""

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics, admission: Admission,
                 names: list[str]):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_config.vocab_size
        self.max_model_len = engine.max_model_len
        self.served_model_names = list(names)
        self.model_name = self.served_model_names[0]
        self.created = int(time.time())
        metrics.add_model(self.model_name)

    # ---- shared steps -------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The name to answer with: the one the request used when it is one of this model's."""
        return model if model in self.served_model_names else self.model_name

    def decode_token(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id])

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None, prompt_param: str,
                           context_limit: int | None = None) -> int:
        """OpenAI's context-length check; an absent max_tokens means 'up to the context limit'
        (the model's, or a smaller one the request sets)."""
        limit = self.max_model_len if context_limit is None else min(context_limit, self.max_model_len)
        num_completion_tokens = requested if requested is not None else max(0, limit - num_prompt_tokens)
        if num_prompt_tokens >= limit or num_prompt_tokens + num_completion_tokens > limit:
            where = "messages" if prompt_param == "messages" else "prompt"
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + num_completion_tokens} tokens ({num_prompt_tokens} in the {where}, "
                f"{num_completion_tokens} for the completion). Please reduce the length of the {where} "
                f"or completion.", param=prompt_param)
        return num_completion_tokens

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"{param}: token id {token_id} is out of range 0..{self.vocab_size - 1}", param=param)

    def new_job(self, response_id: str, prompt_ids_list: list[list[int]], sampling_params: Any,
                params_summary: dict[str, Any], lease: ModelLease | None = None) -> Job:
        ticket = self.admission.admit()
        streams = [EngineStream(self, f"{response_id}-{index}", prompt_ids, sampling_params, params_summary)
                   for index, prompt_ids in enumerate(prompt_ids_list)]
        return Job(ticket, streams, lease)

    async def start_stream(self, http_request: Request, job: Job) -> list[RequestOutput | None]:
        try:
            return await run_watching_disconnect(http_request, job.first_outputs())
        except BaseException:
            await job.close()
            raise

    async def finish(self, http_request: Request, job: Job) -> list[RequestOutput | None]:
        try:
            return await run_watching_disconnect(http_request, job.final_outputs())
        finally:
            await job.close()

    # ---- chat (every dialect's path) ------------------------------------------------------

    async def start_chat(self, http_request: Request, turn: ChatTurn, lease: ModelLease | None, *, stream: bool,
                         response_id: str) -> ChatRun:
        """Prompt, limits, grammar and engine request for a turn; a streamed run has its first output."""
        prompt_ids = turn.prompt_ids(self.tokenizer)
        prompt_param = "prompt" if turn.raw_prompt is not None else "messages"
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), turn.requested_max_tokens, prompt_param,
                                             turn.context_limit)
        kwargs = {**turn.sampling, "max_tokens": max_tokens}
        if turn.calls_possible:
            if kwargs.get("structured_output") is not None:
                raise InvalidRequestError("a response format or structured output cannot be combined with tools "
                                          "unless tool_choice is 'none'", param="response_format")
            kwargs["structured_output"] = tool_call_grammar(turn.tools)
        sampling_params = make_sampling_params(kwargs)
        job = self.new_job(response_id, [prompt_ids], sampling_params, kwargs, lease)
        run = ChatRun(self, http_request, job, turn, prompt_ids, lease.load_seconds if lease else 0.0)
        if stream:
            await run.start_streaming()
        return run

    async def chat(self, http_request: Request, body: ChatCompletionRequest, lease: ModelLease | None = None
                   ) -> Response:
        model = self.check_model(body.model)
        body.check_supported()
        tools = ToolSet.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        turn = ChatTurn(body.messages_as_dicts(), sampling_kwargs(body, vocab_size=self.vocab_size),
                        body.requested_max_tokens, tools, body.add_generation_prompt)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = await self.start_chat(http_request, turn, lease, stream=body.stream, response_id=response_id)
        if body.stream:
            return SSEResponse(guarded_sse(self._chat_events(body, run, response_id, model)), run.job)
        choices = []
        for result in await run.results():
            logprobs = None
            if body.logprobs:
                logprobs = responses.chat_logprobs(result.token_ids, result.logprobs or [], body.top_logprobs or 0,
                                                   self.decode_token)
            choices.append(responses.chat_choice(result.index, result.content, result.finish_reason, logprobs,
                                                 result.tool_calls))
        return JSONResponse(responses.chat_completion(response_id, run.created, model, choices, run.num_prompt_tokens,
                                                      run.num_completion_tokens))

    async def _chat_events(self, body: ChatCompletionRequest, run: ChatRun, response_id: str,
                           model: str) -> AsyncIterator[str]:
        include_usage = body.include_usage_in_stream

        def chunk(choices: list[dict[str, Any]]) -> str:
            return responses.sse_event(responses.chat_chunk(response_id, run.created, model, choices,
                                                            include_usage=include_usage))

        yield chunk([responses.chat_chunk_choice(index, {"role": "assistant", "content": ""}, None)
                     for index in range(body.n)])
        async for delta in run.deltas():
            logprobs = None
            if body.logprobs and delta.logprobs:
                logprobs = responses.chat_logprobs(delta.token_ids, delta.logprobs, body.top_logprobs or 0,
                                                   self.decode_token)
            message: dict[str, Any] = {}
            if delta.content:
                message["content"] = delta.content
            if delta.tool_calls:
                message["tool_calls"] = [call.as_openai() for call in delta.tool_calls]
            if message or delta.finish_reason or logprobs:
                yield chunk([responses.chat_chunk_choice(delta.index, message, delta.finish_reason, logprobs)])
        if include_usage:
            yield responses.sse_event(responses.usage_chunk(response_id, run.created, model, "chat.completion.chunk",
                                                            run.num_prompt_tokens, run.num_completion_tokens))

    # ---- completions --------------------------------------------------------------------

    def _completion_prompts(self, body: CompletionRequest) -> tuple[list[str], list[list[int]]]:
        prompt_texts: list[str] = []
        prompt_ids_list: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
                prompt_text = prompt
            else:
                self.check_token_ids(prompt, "prompt")
                prompt_ids = list(prompt)
                prompt_text = self.tokenizer.decode(prompt_ids)
            if not prompt_ids:
                raise InvalidRequestError("prompt must not be empty", param="prompt")
            prompt_texts.append(prompt_text)
            prompt_ids_list.append(prompt_ids)
        return prompt_texts, prompt_ids_list

    async def completions(self, http_request: Request, body: CompletionRequest,
                          lease: ModelLease | None = None) -> Response:
        model = self.check_model(body.model)
        body.check_supported()
        prompt_texts, prompt_ids_list = self._completion_prompts(body)
        max_tokens = min(self.resolve_max_tokens(len(ids), body.requested_max_tokens, "prompt")
                         for ids in prompt_ids_list)
        # echo with max_tokens 0 (prompt scoring only) still runs one engine step to get prompt
        # logprobs; the generated token is dropped. For 0 or 1 tokens EOS must not end the request
        # early, so that exactly one token follows the prompt (lm-evaluation-harness slices [ctx:-1]).
        is_prompt_only = body.echo and max_tokens == 0
        kwargs = {**sampling_kwargs(body, vocab_size=self.vocab_size), "max_tokens": max(1, max_tokens)}
        if body.echo and max_tokens <= 1:
            kwargs["ignore_eos"] = True
        sampling_params = make_sampling_params(kwargs)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        job = self.new_job(response_id, prompt_ids_list, sampling_params, kwargs, lease)
        created = int(time.time())
        if body.stream:
            first_outputs = await self.start_stream(http_request, job)
            events = self._completion_events(body, job, first_outputs, prompt_texts, response_id, created, model)
            return SSEResponse(guarded_sse(events), job)
        outputs = await self.finish(http_request, job)
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
                    logprobs = self._completion_logprobs(body, stream, output, completion_ids, choice,
                                                         prompt_texts[prompt_index])
                finish_reason = "length" if is_prompt_only else choice.finish_reason
                choices.append(responses.completion_choice(prompt_index * body.n + choice.index, text,
                                                           finish_reason, logprobs))
        num_prompt_tokens = sum(len(ids) for ids in prompt_ids_list)
        return JSONResponse(responses.text_completion(response_id, created, model, choices, num_prompt_tokens,
                                                      num_completion_tokens))

    def _completion_logprobs(self, body: CompletionRequest, stream: EngineStream, output: RequestOutput,
                             completion_ids: list[int], choice, prompt_text: str) -> dict[str, Any]:
        prompt_part = None
        if body.echo:
            if output.prompt_logprobs is None:
                raise InvalidRequestError("echo with logprobs needs prompt logprobs, which the engine did "
                                          "not return", param="echo")
            prompt_part = responses.completion_logprobs(stream.prompt_ids, output.prompt_logprobs,
                                                        self.decode_token)
        generated_logprobs = stream.logprobs_of(choice) or []
        offset = len(prompt_text) if body.echo else 0
        generated_part = responses.completion_logprobs(completion_ids, generated_logprobs[:len(completion_ids)],
                                                       self.decode_token, initial_text_offset=offset)
        return responses.merge_completion_logprobs(prompt_part, generated_part)

    async def _completion_events(self, body: CompletionRequest, job: Job,
                                 first_outputs: list[RequestOutput | None], prompt_texts: list[str],
                                 response_id: str, created: int, model: str) -> AsyncIterator[str]:
        is_echo_pending = {index: body.echo for index in range(len(job.streams) * body.n)}
        text_offsets = {index: len(prompt_texts[index // body.n]) if body.echo else 0
                        for index in is_echo_pending}

        def output_chunk(prompt_index: int, output: RequestOutput) -> str | None:
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
                    logprobs = responses.completion_logprobs(
                        choice.token_ids_delta, choice.logprobs_delta, self.decode_token,
                        initial_text_offset=text_offsets[index])
                    text_offsets[index] += sum(len(token) for token in logprobs["tokens"])
                choices.append(responses.completion_choice(index, text, choice.finish_reason, logprobs))
            if not choices:
                return None
            return responses.sse_event(responses.text_completion(response_id, created, model, choices, None, None))

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
            yield responses.sse_event(responses.usage_chunk(
                response_id, created, model, "text_completion", num_prompt_tokens, num_completion_tokens))

    # ---- embeddings (OpenAI's /v1/embeddings and Ollama's /api/embed) --------------------

    async def embed(self, http_request: Request, prompt_ids_list: list[list[int]], lease: ModelLease | None,
                    param: str = "input") -> list[list[float]]:
        """One L2-normalized vector per prompt: its final hidden states pooled (--pooling). A
        generative model's pooled states are not a trained sentence embedding: they serve
        similarity search roughly, retrieval-tuned embedding models do it better (docs/apis.md)."""
        import math

        for prompt_ids in prompt_ids_list:
            if not prompt_ids:
                raise InvalidRequestError(f"{param} must not be empty", param=param)
            self.resolve_max_tokens(len(prompt_ids), 1, param)
        kwargs = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True, "pooling": self.settings.pooling}
        job = self.new_job(f"embd-{uuid.uuid4().hex}", prompt_ids_list, make_sampling_params(kwargs), kwargs, lease)
        outputs = await self.finish(http_request, job)
        vectors = []
        for output in outputs:
            if output is None or output.embedding is None:
                raise InvalidRequestError("the engine returned no embedding for an input", param=param)
            norm = math.sqrt(sum(value * value for value in output.embedding)) or 1.0
            vectors.append([value / norm for value in output.embedding])
        return vectors

    async def embeddings(self, http_request: Request, body: EmbeddingRequest, lease: ModelLease | None) -> Response:
        """OpenAI's /v1/embeddings: texts or token id lists in, one vector each (float or base64)."""
        import base64
        import struct

        model = self.check_model(body.model)
        hidden_size = self.engine.model_config.hidden_size
        if body.dimensions is not None and body.dimensions != hidden_size:
            raise InvalidRequestError(f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot "
                                      f"be shortened, got {body.dimensions}", param="dimensions")
        prompt_ids_list = []
        for item in body.inputs():
            if isinstance(item, str):
                prompt_ids_list.append(self.tokenizer.encode(item, add_special_tokens=True))
            else:
                self.check_token_ids(item, "input")
                prompt_ids_list.append(list(item))
        vectors = await self.embed(http_request, prompt_ids_list, lease)
        data = []
        for index, vector in enumerate(vectors):
            encoded: Any = vector
            if body.encoding_format == "base64":  # float32 little-endian, as OpenAI's
                encoded = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": encoded})
        num_tokens = sum(len(ids) for ids in prompt_ids_list)
        return JSONResponse({"object": "list", "data": data, "model": model,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    # ---- utilities ----------------------------------------------------------------------

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        body.check_supported()
        if body.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [{"role": message.role, "content": message.text()} for message in body.messages],
                add_generation_prompt=body.add_generation_prompt)
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            token_ids = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": token_ids, "count": len(token_ids), "max_model_len": self.max_model_len}

    def tokenizer_info(self) -> dict[str, Any]:
        """What a remote tokenizer needs (lm-evaluation-harness's `tokenizer_backend=remote`, as
        vLLM serves it): the special tokens, the chat template and the context length; encoding
        and decoding go through /tokenize and /detokenize."""
        tokenizer = self.tokenizer
        return {"model": self.model_name, "tokenizer_class": type(tokenizer).__name__,
                "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
                "pad_token": None, "chat_template": tokenizer.chat_template,
                "model_max_length": self.max_model_len, "vocab_size": self.vocab_size}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        self.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}
