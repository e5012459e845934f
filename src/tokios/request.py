"""The engine core's unit of work: one sequence, its token ids, how many are computed, its status.

Two words, two levels. A *request* is what a caller sends: one prompt, SamplingParams with n
samples, one request id, one stream of RequestOutputs (outputs.py); the front end
(engine/output_processor.py, AsyncEngine, LLM, the server) works on requests. A *sequence* is
one of its n samples: the front end makes n of them (EngineCore.make_requests), with ids
`sequence_ids(request_id, n)`: the request id itself when n == 1, else `request_id#0` ..
`request_id#{n-1}`. Below the front end (scheduler, KV manager, runner, sampler, speculator)
everything is per sequence, and the class that carries one is this `Request`, the name the
scheduler literature uses (vLLM's too): there, `request_id`, `scheduler.requests`,
`ScheduledRequest` and `finished_request_ids` all mean sequences. Where the two levels meet the
names say which: EngineOutput.sequence_id, EngineCore.abort(sequence_ids), the
AddRequest command's `sequences`.

The scheduler and KV manager read and advance this; nothing here touches tensors or text. The
first of n sequences is the parent; the others fork its prompt blocks once the parent's prompt
is computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tokios.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """One sequence: a request's prompt and one of its n samples (see the module docstring)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, never past the context limit
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    sample_index: int = 0  # which of the n samples this sequence is
    parent: "Request | None" = None  # for sample_index > 0: whose prompt blocks to fork
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    # Per-request sampling state kept by the runner (generator, penalty counts).
    sampling_state: object | None = None
    # Speculative decoding. num_speculative_tokens: how many proposed tokens the scheduler may
    # reserve room for in the next step (0: plain decoding); set by the speculator, read by the
    # scheduler as an int. spec_token_ids: this step's proposed tokens, verified after the
    # request's last token; never part of all_token_ids (so never hashed into the prefix cache)
    # and cleared by Scheduler.update once verified.
    num_speculative_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    # Per-request speculation state kept by the speculator (method, acceptance history).
    spec_state: object | None = None
    # Structured output: this sequence's tokios.structured.GrammarMatcher, advanced with every
    # appended token; the runner masks this sequence's logits with it.
    grammar: object | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids or ())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """After a new token: did the request end? (Stop strings are the front end's job.)"""
        num_output = self.num_output_tokens
        last = self.all_token_ids[-1]
        if num_output >= self.sampling_params.min_tokens:
            if not self.sampling_params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if self.grammar is not None and self.grammar.is_finished:
                # Complete under its grammar, which admits nothing but EOS from here. (Before
                # min_tokens the next step finds nothing to sample: that request fails, 400.)
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
