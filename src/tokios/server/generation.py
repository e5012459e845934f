"""The one internal chat request and the one streaming path that every API dialect shares.

OpenAI chat completions, OpenAI Responses, Anthropic Messages and Ollama's chat and generate
differ in their JSON, not in what they ask of the engine. Each dialect translates its body into
a `ChatTurn` (OpenAI-shaped message dicts, a ToolSet, SamplingParams keyword arguments) and
renders what a `ChatRun` yields:

- `ChatRun.deltas()`: per choice, the new content text, tool-call deltas (the tool-call parser
  holds back anything that may be call text), token ids and logprobs, and the finish reason;
- `ChatRun.results()`: the same, whole, for a non-streamed answer (the same parser, fed the whole
  text, so both answers come from one code path);
- counts and timings (prompt, cached prompt and completion tokens, time to first token, load
  wait), which the dialects report in their own units.

Prompt building (chat template, tool prompt, tool-call grammar), the context-length check,
stop strings and detokenization all happen once, here and below (Serving, the engine's output
processor). server/serving.py's `Serving.start_chat` builds runs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tokios.outputs import RequestOutput, TokenLogprobs
from tokios.reasoning import AnswerParser, ReasoningFormat, ThinkingRequest, answer_parser
from tokios.tool_calls import ToolSet
from tokios.tool_calls.parser import ToolCallDelta
from tokios.tool_calls.prompt import template_inputs

if TYPE_CHECKING:
    from starlette.requests import Request

    from tokios.outputs import Logprob
    from tokios.sampling_defaults import SamplingDefaults
    from tokios.server.streams import Job
    from tokios.tokenizer.tokenizer import Tokenizer


class RunOwner(Protocol):
    """What a ChatRun (and a dialect, through `run.serving`) uses of the Serving that starts it
    (server/serving.py). Named here so that serving.py imports this module and this module never
    imports serving.py."""

    async def start_stream(self, http_request: Request, job: Job) -> list[RequestOutput | None]: ...

    async def finish(self, http_request: Request, job: Job) -> list[RequestOutput | None]: ...

    def decode_token(self, token_id: int, logprob: Logprob | None = None) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def sampling_defaults(self) -> SamplingDefaults: ...


@dataclass
class ChatTurn:
    """What a chat request asks of the engine, whatever API it came through."""

    messages: list[dict[str, Any]]  # OpenAI-shaped: role, content, tool_calls, tool_call_id
    sampling: dict[str, Any]  # SamplingParams keyword arguments, max_tokens left out
    requested_max_tokens: int | None = None  # None: up to the context limit
    tools: ToolSet | None = None
    add_generation_prompt: bool = True
    # A prompt given as text to run without the chat template (Ollama's raw generate).
    raw_prompt: str | None = None
    # A context smaller than the model's for this request (Ollama's num_ctx): prompt + output.
    context_limit: int | None = None
    # What the request asks of a reasoning model's thinking, and variables for the chat template
    # (OpenAI's chat_template_kwargs; Serving adds enable_thinking / reasoning_effort).
    thinking: ThinkingRequest = field(default_factory=ThinkingRequest)
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def calls_possible(self) -> bool:
        return self.tools is not None and self.tools.calls_possible

    def prompt_text(self, tokenizer: Tokenizer) -> tuple[str, bool]:
        """The prompt as text, and whether encoding it adds the tokenizer's special tokens: the
        chat template over the messages (and tools), or the raw prompt."""
        if self.raw_prompt is not None:
            return self.raw_prompt, True
        messages, template_tools = template_inputs([_with_reasoning_names(message) for message in self.messages],
                                                   self.tools, tokenizer.chat_template_takes_tools)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt,
                                             tools=template_tools, **self.template_kwargs), False

    def prompt_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prompt's token ids. The gateway's prefix-aware routing hashes the same ids from the
        same text (gateway/prefix_index.py)."""
        text, add_special_tokens = self.prompt_text(tokenizer)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _with_reasoning_names(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's reasoning under both names templates read it by: `reasoning_content`
    (Qwen3, DeepSeek, GLM...) and `thinking` (gpt-oss). Whether a template keeps or drops it is
    the template's choice, as its authors wrote it."""
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if not reasoning:
        return message
    return {**message, "reasoning_content": reasoning, "thinking": reasoning}


@dataclass
class ChoiceDelta:
    """What one output adds to one choice."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class ChoiceResult:
    """One whole choice of a non-streamed answer."""

    index: int
    content: str | None
    tool_calls: list[dict[str, Any]]  # OpenAI message shape: {"id", "type", "function": {...}}
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    reasoning: str | None = None  # a reasoning model's thinking (None: it did not think)
    num_reasoning_tokens: int = 0


@dataclass(frozen=True)
class ReasoningSetup:
    """How a run's output is read: the model's reasoning format and whether the prompt opened
    the thinking (Serving.start_chat decides both from the rendered prompt)."""

    reasoning_format: ReasoningFormat | None = None
    starts_inside: bool = False


class ChatRun:
    """A started generation for a ChatTurn: a job of one engine request (n choices)."""

    def __init__(self, serving: RunOwner, http_request: Request, job: Job, turn: ChatTurn, prompt_ids: list[int],
                 load_seconds: float, reasoning: ReasoningSetup = ReasoningSetup()):
        self.serving = serving
        self.reasoning = reasoning
        self.http_request = http_request
        self.job = job
        self.turn = turn
        self.prompt_ids = prompt_ids
        self.load_seconds = load_seconds
        self.created = int(time.time())
        self._first_output: RequestOutput | None = None
        self._parsers: dict[int, AnswerParser] = {}
        self._index_to_num_reasoning_tokens: dict[int, int] = {}

    @property
    def stream(self):
        return self.job.streams[0]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens found in the engine's prefix cache (the rest were computed): what OpenAI's
        cached_tokens, Anthropic's cache_read_input_tokens and Ollama's prompt_eval_count read."""
        return self.stream.num_cached_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        output = self.stream.last_output
        return 0 if output is None else sum(len(choice.token_ids) for choice in output.outputs)

    async def start_streaming(self) -> None:
        """Waits for the first output, so that bad input is an HTTP error before the first byte."""
        self._first_output = (await self.serving.start_stream(self.http_request, self.job))[0]

    @property
    def parses_output(self) -> bool:
        """Whether the output is read for reasoning or calls (else it is all content, as it comes)."""
        return self.reasoning.reasoning_format is not None or self.turn.calls_possible

    def _parser(self, index: int) -> AnswerParser:
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = answer_parser(self.reasoning.reasoning_format, self.reasoning.starts_inside,
                                                          self.turn.calls_possible)
        return parser

    @property
    def num_reasoning_tokens(self) -> int:
        """The thinking's tokens over every choice (its text re-encoded: the text the model wrote
        encodes to the tokens it wrote, so streamed and whole answers count alike)."""
        return sum(self._index_to_num_reasoning_tokens.values())

    def _count_reasoning(self, index: int, parser: AnswerParser) -> int:
        reasoning = parser.reasoning
        count = 0
        if reasoning or parser.is_reasoning:
            count = len(self.serving.tokenizer.encode(reasoning, add_special_tokens=False))
        self._index_to_num_reasoning_tokens[index] = count
        return count

    def _deltas_of(self, output: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for choice in output.outputs:
            delta = ChoiceDelta(choice.index, token_ids=choice.token_ids_delta, logprobs=choice.logprobs_delta,
                                finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            if not self.parses_output:
                delta.content = choice.text_delta
            else:
                parser = self._parser(choice.index)
                parsed = parser.feed(choice.text_delta)
                if choice.finish_reason:
                    rest = parser.finish()
                    parsed.reasoning += rest.reasoning
                    parsed.content += rest.content
                    parsed.tool_calls += rest.tool_calls
                    delta.finish_reason = tool_finish_reason(choice.finish_reason, parser)
                    self._count_reasoning(choice.index, parser)
                delta.content, delta.tool_calls, delta.reasoning = parsed.content, parsed.tool_calls, parsed.reasoning
            if (delta.content or delta.reasoning or delta.tool_calls or delta.finish_reason or delta.logprobs
                    or delta.token_ids):
                deltas.append(delta)
        return deltas

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Every choice's deltas in order, ending with each choice's finish reason."""
        if self._first_output is not None:
            for delta in self._deltas_of(self._first_output):
                yield delta
        async for _, output in self.job.rest():
            for delta in self._deltas_of(output):
                yield delta

    async def results(self) -> list[ChoiceResult]:
        """Waits for the whole answer (the job is closed after)."""
        output = (await self.serving.finish(self.http_request, self.job))[0]
        results = []
        for choice in output.outputs:
            logprobs = self.stream.logprobs_of(choice)
            if not self.parses_output:
                results.append(ChoiceResult(choice.index, choice.text, [], choice.token_ids, logprobs,
                                            choice.finish_reason, choice.stop_reason))
                continue
            parser = self._parser(choice.index)
            parser.feed(choice.text)
            parser.finish()
            # With calls, the content is null unless the model wrote text before them (OpenAI);
            # not stripped, so that it equals the streamed content byte for byte.
            content = (parser.content or None) if parser.has_calls else parser.content
            thought = self.reasoning.reasoning_format is not None and (parser.reasoning or parser.is_reasoning)
            results.append(ChoiceResult(choice.index, content, parser.tool_calls(), choice.token_ids, logprobs,
                                        tool_finish_reason(choice.finish_reason, parser), choice.stop_reason,
                                        parser.reasoning if thought else None,
                                        self._count_reasoning(choice.index, parser)))
        return results

    def durations_ns(self) -> dict[str, int]:
        """Ollama's timing fields: total, load, prompt evaluation (to the first token) and generation."""
        stream = self.stream
        end = stream.last_token_time or time.monotonic()
        first = stream.first_token_time or end
        return {"total_duration": int((end - stream.start_time + self.load_seconds) * 1e9),
                "load_duration": int(self.load_seconds * 1e9),
                "prompt_eval_duration": int((first - stream.start_time) * 1e9),
                "eval_duration": int((end - first) * 1e9)}


def tool_finish_reason(finish_reason: str | None, parser: AnswerParser) -> str | None:
    """"tool_calls" when the answer ended with whole calls, also when max_tokens ran out after
    the last one ended; "length" when a call was cut short (its arguments are incomplete JSON)."""
    if parser.has_calls and (finish_reason == "stop" or (finish_reason == "length" and not parser.has_open_call)):
        return "tool_calls"
    return finish_reason
