"""One loaded model's serving steps, shared by every dialect: prompt -> token ids ->
SamplingParams (the model's sampling defaults where the request sets none) -> engine streams.

Owns what happens between a dialect's translated request and the engine: the chat template and
tokenization (via engine.tokenizer, through server/generation.py's ChatTurn), the context-length
check with OpenAI's message, the tool-call grammar, admission (server/admission.py), running the
engine streams (server/streams.py) with disconnect watching, and pooled embeddings. The dialects
(server/dialects/) shape what comes out; `ServerSettings` are the server's settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from tokios.encoder.loader import GENERATE
from tokios.errors import ContextLengthExceededError, InvalidRequestError
from tokios.outputs import Logprob, RequestOutput
from tokios.sampling_defaults import TOKIOS as TOKIOS_SAMPLING, SamplingDefaults
from tokios.server.admission import Admission
from tokios.server.embeddings import EmbeddingService
from tokios.reasoning import (HARMONY, THINK, ReasoningFormat, ThinkingBudget, ThinkingPlan, plan_thinking,
                              resolve_reasoning_format)
from tokios.reasoning.grammar import reasoning_rules
from tokios.reasoning.harmony_grammar import MARKERS as HARMONY_MARKERS, harmony_tool_call_grammar
from tokios.server.generation import ChatRun, ChatTurn, ReasoningSetup
from tokios.server.metrics import ServerMetrics
from tokios.server.registry import ModelLease
from tokios.server.streams import EngineStream, Job, run_watching_disconnect
from tokios.tool_calls.call_format import CALL_CLOSE, CALL_OPEN
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
    # A reasoning model's format (tokios.reasoning): "auto" reads it from the model's files.
    reasoning_format: str = "auto"
    # The OpenAI Responses API's store (previous_response_id, GET /v1/responses/{id}).
    responses_store_size: int = 1000
    responses_store_ttl_s: float = 3600.0


def make_sampling_params(kwargs: dict[str, Any]):
    """SamplingParams from protocol.sampling_kwargs; its ValueErrors become 400s naming the field."""
    from tokios.sampling_params import SamplingParams

    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError:
        raise
    except (ValueError, TypeError) as exc:
        message = str(exc)
        first_word = message.split(" ", 1)[0].strip(":,")
        raise InvalidRequestError(message, param=first_word if first_word in kwargs else None) from exc


class Serving:
    """One loaded model's serving steps (server/registry.py makes one per loaded engine)."""

    def __init__(self, engine: Any, settings: ServerSettings, metrics: ServerMetrics, admission: Admission,
                 names: list[str], sampling_defaults: SamplingDefaults = TOKIOS_SAMPLING):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.admission = admission
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        self.served_model_names = list(names)
        self.model_name = self.served_model_names[0]
        self.created = int(time.time())
        self.sampling_defaults = sampling_defaults
        self.embedding = EmbeddingService.of(engine, self.model_name, settings.pooling)
        self.kind = self.embedding.kind
        self.reasoning_format = (self._reasoning_format(settings.reasoning_format) if self.kind == GENERATE
                                 else None)
        metrics.add_model(self.model_name)

    def _reasoning_format(self, choice: str) -> ReasoningFormat | None:
        """The model's reasoning format; the markers that are special tokens are shown in the output
        text (decoding skips special tokens), so the output parser sees them."""
        tokenizer = self.tokenizer
        vocabulary = frozenset(marker for marker in THINK.markers if tokenizer.single_token_id(marker) is not None)
        reasoning_format = resolve_reasoning_format(choice, tokenizer.chat_template, vocabulary)
        if reasoning_format is not None:
            marker_ids = (tokenizer.single_token_id(marker) for marker in reasoning_format.markers)
            tokenizer.show_special_tokens(token_id for token_id in marker_ids if token_id is not None)
        return reasoning_format

    # ---- shared steps -------------------------------------------------------------------

    def response_model_name(self, model: str | None) -> str:
        """The model name an answer carries: the one the request used when it is one of this
        model's names, else its first name."""
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

    def sampling_params(self, request_kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A generation's SamplingParams: the request's fields, the model's defaults where it
        sets none (one set for every dialect); also the keywords, for the request log."""
        kwargs = self.sampling_defaults.apply(request_kwargs)
        return make_sampling_params(kwargs), kwargs

    def new_job(self, response_id: str, prompt_ids_list: list[list[int]], sampling_params: Any,
                params_summary: dict[str, Any], lease: ModelLease | None = None) -> Job:
        if sampling_params.pooling is None:  # a pooling request is an embedding, not a generation
            self.embedding.require(GENERATE)
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
        reasoning_format = self._turn_reasoning_format(turn)
        plan, prompt_text, prompt_ids = self.chat_prompt(turn)
        prompt_param = "prompt" if turn.raw_prompt is not None else "messages"
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), turn.requested_max_tokens, prompt_param,
                                             turn.context_limit)
        kwargs = {**turn.sampling, "max_tokens": max_tokens}
        reasoning = ReasoningSetup(reasoning_format, reasoning_format is not None
                                   and reasoning_format.prompt_opens_reasoning(prompt_text))
        # The model thinks (or must be stopped from thinking): the budget's matcher follows it,
        # and a tool-call grammar lets the thinking through first.
        thinks = reasoning_format is not None and (plan.is_enabled or plan.max_thinking_tokens is not None)
        if thinks:
            kwargs["thinking_budget"] = self._thinking_budget(
                reasoning, plan.max_thinking_tokens, turn.calls_possible and turn.tools.calls_required,
                grammar_after_thinking=not turn.calls_possible and kwargs.get("structured_output") is not None)
        if turn.calls_possible:
            if kwargs.get("structured_output") is not None:
                raise InvalidRequestError("a response format or structured output cannot be combined with tools "
                                          "unless tool_choice is 'none'", param="response_format")
            kwargs["structured_output"] = self._tool_call_grammar(turn, reasoning, thinks)
        sampling_params, kwargs = self.sampling_params(kwargs)
        job = self.new_job(response_id, [prompt_ids], sampling_params, kwargs, lease)
        run = ChatRun(self, http_request, job, turn, prompt_ids, lease.load_seconds if lease else 0.0, reasoning)
        if stream:
            await run.start_streaming()
        return run

    def chat_prompt(self, turn: ChatTurn) -> tuple[ThinkingPlan, str, list[int]]:
        """A turn's thinking plan (its template variables set on the turn), prompt text and ids:
        what start_chat runs and what a token count (Anthropic's count_tokens) counts."""
        plan = plan_thinking(turn.thinking.with_template_switch(turn.template_kwargs),
                             self._turn_reasoning_format(turn), self.tokenizer.chat_template_variables)
        turn.template_kwargs = {**turn.template_kwargs, **plan.template_kwargs}
        prompt_text, add_special_tokens = turn.prompt_text(self.tokenizer)
        return plan, prompt_text, self.tokenizer.encode(prompt_text, add_special_tokens=add_special_tokens)

    def _turn_reasoning_format(self, turn: ChatTurn) -> ReasoningFormat | None:
        """The model's reasoning format, for a turn its chat template renders (a raw prompt's
        output is read as it comes)."""
        return self.reasoning_format if turn.raw_prompt is None else None

    def _special_token_ids(self, texts) -> dict[str, int]:
        """text -> id of those of `texts` that are one special token each (a grammar names them
        as `<[id]>`: their text does not match the token)."""
        special_ids = set(self.tokenizer.all_special_ids)
        text_to_id = {text: self.tokenizer.single_token_id(text) for text in texts}
        return {text: token_id for text, token_id in text_to_id.items() if token_id in special_ids}

    def _thinking_budget(self, reasoning: ReasoningSetup, max_thinking_tokens: int | None,
                         calls_required: bool, grammar_after_thinking: bool) -> ThinkingBudget:
        reasoning_format = reasoning.reasoning_format
        forced_end = reasoning_format.forced_end
        if calls_required and reasoning_format.forced_end_before_call is not None:
            forced_end = reasoning_format.forced_end_before_call

        def ids(text: str) -> tuple[int, ...]:
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))

        start_ids, end_ids, forced_ids = ids(reasoning_format.start), ids(reasoning_format.end), ids(forced_end)
        # An end of sequence that is also the thinking's close (or part of what closes it) must
        # stay possible while thinking.
        stop_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) - set(end_ids) - set(forced_ids)))
        return ThinkingBudget(max_thinking_tokens, start_ids, end_ids, forced_ids, reasoning.starts_inside, stop_ids,
                              grammar_after_thinking)

    def _tool_call_grammar(self, turn: ChatTurn, reasoning: ReasoningSetup, thinks: bool):
        """gpt-oss's calls in harmony's messages; any other model's in the `<tool_call>` format,
        after its thinking when it thinks."""
        if reasoning.reasoning_format == HARMONY:
            return harmony_tool_call_grammar(turn.tools, self._special_token_ids(HARMONY_MARKERS))
        return tool_call_grammar(turn.tools, self._reasoning_grammar(reasoning) if thinks else None,
                                 self._special_token_ids((CALL_OPEN, CALL_CLOSE)))

    def _reasoning_grammar(self, reasoning: ReasoningSetup) -> tuple[str, list[str]]:
        """The thinking a tool-call grammar lets through first (reasoning/grammar.py)."""
        reasoning_format = reasoning.reasoning_format
        marker_to_id = self._special_token_ids((reasoning_format.start, reasoning_format.end))
        return reasoning_rules(reasoning_format, reasoning.starts_inside, marker_to_id.get(reasoning_format.start),
                               marker_to_id.get(reasoning_format.end))
