"""The front end of the engine: token ids in, text out.

Turns the core's per-step token deltas into RequestOutputs: incremental detokenization
(UTF-8-safe), stop strings (held back while they might still match, never emitted unless asked),
logprobs shaping, n > 1 samples grouped under one request id, and timing metrics. When a stop
string matches, it tells the caller which sequence to abort in the core. Used by both LLM and
AsyncEngine so that offline and streaming output are the same text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tokios.errors import TokiosError
from tokios.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs
from tokios.sampling_params import SamplingParams
from tokios.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


@dataclass
class EngineOutput:
    """What the core reports for one sequence after a step."""

    sequence_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[int, float, int | None, list[tuple[int, float]]]] | None = None
    new_prompt_logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic() when the scheduler first admitted it
    spec_counts: tuple[int, int, int] = (0, 0, 0)  # so far: drafts, draft tokens, accepted tokens
    # The pooled prompt hidden states (SamplingParams.pooling), once the whole prompt is computed.
    embedding: list[float] | None = None
    # Set when this sequence failed on its own (sampler found nothing to sample); its request fails.
    error: TokiosError | None = None


@dataclass
class _SequenceState:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    wants_logprobs: bool
    spec_counts: tuple[int, int, int] = (0, 0, 0)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    embedding: list[float] | None = None
    num_finished: int = 0


def sequence_ids(request_id: str, n: int) -> list[str]:
    """Core-side ids of the n samples of one request (n == 1 keeps the request id itself)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.sequence_to_request: dict[str, tuple[str, int]] = {}
        # Requests that failed during process(), with their error; the caller takes them
        # (take_failures), reports each to its own client, and aborts their other sequences.
        self._failures: list[tuple[str, TokiosError]] = []

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> None:
        sequences = []
        for index, sequence_id in enumerate(sequence_ids(request_id, params.n)):
            stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
            sequences.append(_SequenceState(
                CompletionOutput(index=index, logprobs=[] if params.logprobs is not None else None,
                                 cumulative_logprob=0.0 if params.logprobs is not None else None),
                IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens),
                stop_matcher, params.logprobs is not None))
            self.sequence_to_request[sequence_id] = (request_id, index)
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, sequences,
            RequestMetrics(arrival_time=arrival_time or time.monotonic()),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def remove_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            for sequence_id in sequence_ids(request_id, state.params.n):
                self.sequence_to_request.pop(sequence_id, None)

    def process(self, engine_outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs of requests that changed, and the sequence ids that a stop
        string finished (the caller aborts them in the core). A request one of whose sequences
        failed is removed and reported by take_failures() instead; its other sequences are in the
        abort list."""
        now = time.monotonic()
        touched: dict[str, _RequestState] = {}
        sequences_to_abort: list[str] = []
        for engine_output in engine_outputs:
            location = self.sequence_to_request.get(engine_output.sequence_id)
            if location is None:
                continue
            request_id, index = location
            state = self.requests[request_id]
            sequence = state.sequences[index]
            if sequence.output.finished:
                continue
            if engine_output.error is not None:
                touched.pop(request_id, None)
                sequences_to_abort.extend(sequence_id for sequence_id in sequence_ids(request_id, state.params.n)
                                          if sequence_id != engine_output.sequence_id)
                self._failures.append((request_id, engine_output.error))
                self.remove_request(request_id)
                continue
            touched[request_id] = state
            if engine_output.new_prompt_logprobs:
                state.prompt_logprobs.extend(self._prompt_logprobs(engine_output.new_prompt_logprobs))
            if engine_output.embedding is not None:
                state.embedding = engine_output.embedding
            if engine_output.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
            scheduled_time = engine_output.first_scheduled_time
            if scheduled_time is not None:  # n > 1: the request was scheduled when its first sample was
                known = state.metrics.first_scheduled_time
                state.metrics.first_scheduled_time = scheduled_time if known is None else min(known, scheduled_time)
            # n > 1: the prompt is counted once, as its first sample found it (the others fork it).
            state.metrics.num_cached_prompt_tokens = max(state.metrics.num_cached_prompt_tokens,
                                                         engine_output.num_cached_tokens)
            state.metrics.num_preemptions = max(state.metrics.num_preemptions, engine_output.num_preemptions)
            if engine_output.spec_counts != sequence.spec_counts:  # only speculating requests pay
                sequence.spec_counts = engine_output.spec_counts
                metrics = state.metrics
                metrics.spec_num_drafts, metrics.spec_num_draft_tokens, metrics.spec_num_accepted_tokens = (
                    sum(counts) for counts in zip(*(s.spec_counts for s in state.sequences)))
            if self._append(sequence, engine_output):
                sequences_to_abort.append(engine_output.sequence_id)
            if sequence.output.finished:
                state.num_finished += 1
        results = [self._snapshot(state, now) for state in touched.values()]
        return results, sequences_to_abort

    def take_failures(self) -> list[tuple[str, TokiosError]]:
        """(request id, error) of every request that failed since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def _append(self, sequence: _SequenceState, engine_output: EngineOutput) -> bool:
        """Fold new tokens into one sequence; True when a stop string ended it here."""
        output = sequence.output
        for position, token_id in enumerate(engine_output.new_token_ids):
            output.token_ids.append(token_id)
            output.token_ids_delta.append(token_id)
            if sequence.wants_logprobs and engine_output.new_logprobs:
                self._append_logprobs(output, engine_output.new_logprobs[position])
            if self._emit_until_stop(sequence, sequence.detokenizer.add_tokens([token_id])):
                return True
        if engine_output.finish_reason is not None:
            if self._emit_until_stop(sequence, sequence.detokenizer.flush()):
                return False  # the core has finished it already: nothing to abort
            if sequence.stop_matcher is not None:
                self._emit(output, sequence.stop_matcher.flush())  # held text that never became a stop
            output.finish_reason = engine_output.finish_reason
            output.stop_reason = engine_output.stop_reason
        return False

    def _emit_until_stop(self, sequence: _SequenceState, text: str) -> bool:
        """Emit text through the stop matcher; True (and the sequence finished) when a stop
        string completed in it."""
        output = sequence.output
        if sequence.stop_matcher is not None:
            text, matched = sequence.stop_matcher.feed(text)
            if matched is not None:
                self._emit(output, text)
                output.finish_reason, output.stop_reason = "stop", matched
                return True
        self._emit(output, text)
        return False

    @staticmethod
    def _emit(output: CompletionOutput, text: str) -> None:
        if text:
            output.text += text
            output.text_delta += text

    def _append_logprobs(self, output: CompletionOutput, entry) -> None:
        token_id, logprob, rank, top = entry
        token_logprobs: TokenLogprobs = {token_id: Logprob(logprob, rank, self._piece(token_id))}
        for rank_index, (top_id, top_logprob) in enumerate(top, start=1):
            if top_id not in token_logprobs:
                token_logprobs[top_id] = Logprob(top_logprob, rank_index, self._piece(top_id))
        output.logprobs.append(token_logprobs)
        if output.logprobs_delta is None:
            output.logprobs_delta = []
        output.logprobs_delta.append(token_logprobs)
        output.cumulative_logprob += logprob

    def _prompt_logprobs(self, entries) -> list[TokenLogprobs]:
        result = []
        for token_id, logprob, top in entries:
            token_logprobs: TokenLogprobs = {token_id: Logprob(logprob, None, self._piece(token_id))}
            for rank_index, (top_id, top_logprob) in enumerate(top, start=1):
                token_logprobs.setdefault(top_id, Logprob(top_logprob, rank_index, self._piece(top_id)))
            result.append(token_logprobs)
        return result

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _snapshot(self, state: _RequestState, now: float) -> RequestOutput:
        """The RequestOutput to hand out now; resets the per-sequence deltas."""
        finished = state.num_finished == len(state.sequences)
        if finished:
            state.metrics.finished_time = now
        outputs = []
        for index, sequence in enumerate(state.sequences):
            current = sequence.output
            snapshot = CompletionOutput(
                index=current.index, text=current.text, token_ids=current.token_ids,
                cumulative_logprob=current.cumulative_logprob,
                logprobs=current.logprobs, finish_reason=current.finish_reason, stop_reason=current.stop_reason,
                text_delta=current.text_delta, token_ids_delta=current.token_ids_delta,
                logprobs_delta=current.logprobs_delta)
            current.text_delta, current.token_ids_delta, current.logprobs_delta = "", [], None
            outputs.append(snapshot)
        if finished:
            self.remove_request(state.request_id)
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outputs, finished,
                             state.prompt_logprobs, state.metrics, state.embedding)

    def abort_outputs(self, request_id: str) -> RequestOutput | None:
        """Finish every unfinished sequence of a request with reason 'abort' (flushing held text)."""
        state = self.requests.get(request_id)
        if state is None:
            return None
        for sequence in state.sequences:
            if not sequence.output.finished:
                self._append(sequence, EngineOutput(sequence_id="", new_token_ids=[], finish_reason="abort"))
                state.num_finished += 1
        return self._snapshot(state, time.monotonic())
