"""What the engine hands to its callers (LLM, AsyncEngine, the server).

Shaped like vLLM's RequestOutput / CompletionOutput so that code written against vLLM reads the
same: `output.outputs[0].text`, `.token_ids`, `.finish_reason`. Streaming callers also get the
`*_delta` fields: what is new since the previous output of the same request.

While a request runs, `token_ids` and `logprobs` of successive outputs are the same growing
lists (copying them every step would cost O(length) per token); read the deltas when streaming,
or copy the list to keep a snapshot. The final output's lists no longer change.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per generated token: token id -> Logprob (the sampled token and the top alternatives).
TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""
    token_ids_delta: list[int] = field(default_factory=list)
    logprobs_delta: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_prompt_tokens: int = 0
    # Speculative decoding, summed over the request's samples: verifications with proposals,
    # proposed tokens, accepted tokens.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    # The prompt's pooled final hidden states (SamplingParams.pooling), once computed.
    embedding: list[float] | None = None
