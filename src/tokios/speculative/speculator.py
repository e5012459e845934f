"""The speculator: which requests speculate, with how many tokens, and what it earned.

Per engine step (EngineCore.step):
  schedule()  the scheduler reserves 1 + k slots for a decoding request whose
              request.num_speculative_tokens = k (this module sets it);
  propose()   each method's proposer fills request.spec_token_ids (at most the reserved k) and
              the scheduled token count shrinks to 1 + len(proposals);
  runner      verifies them in the same batch as everyone else (rejection sampler);
  update()    the scheduler appends accepted + bonus tokens and rolls back the rest;
  observe()   acceptance statistics (engine-wide and per request), adaptive k, break-even.

Adaptive k: per request, the acceptance rate a is estimated from its verifications (accepted
tokens / positions tried, with a weak prior). k is chosen to maximize the expected speedup
(1 - a^(k+1)) / (1 - a) / (1 + k c) (speculative/speedup.py), where c = the draft's measured seconds per token / a plain
step's measured seconds + the configured cost of a verify row. When even the best k is below
1 (break-even) after a few verifications, speculation is switched off for that request.

Every request may speculate: verify rows apply penalties and min_tokens with the proposals before
their position counted, and report logprobs for whichever token each row emits.

Talks to: Request (num_speculative_tokens, spec_token_ids, spec_state), ScheduledRequest,
the proposers, EngineCore (stats).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokios.config import SpeculativeConfig
from tokios.errors import InvalidRequestError
from tokios.request import Request
from tokios.speculative.proposers import Proposer
from tokios.speculative.speedup import expected_speedup

# Prior for a request's acceptance estimate: as if PRIOR_TRIED positions had been tried with
# PRIOR_ACCEPTANCE of them accepted (optimistic enough to start with the full k).
PRIOR_TRIED = 4.0
PRIOR_ACCEPTANCE = 0.7
# Verifications before the break-even test may switch a request off.
MIN_VERIFICATIONS_BEFORE_OFF = 4
# Weight of a new timing in the moving averages of step and draft time.
TIMING_WEIGHT = 0.1


@dataclass
class RequestSpecState:
    method: str
    max_num_tokens: int
    num_tried: float = PRIOR_TRIED
    num_accepted: float = PRIOR_TRIED * PRIOR_ACCEPTANCE
    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    is_off: bool = False

    @property
    def acceptance(self) -> float:
        return self.num_accepted / self.num_tried


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # verifications with at least one proposed token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + bonus/correction tokens of those verifications
    accepted_per_position: list[int] = field(default_factory=list)  # index j: drafts whose token j was accepted
    drafts_per_position: list[int] = field(default_factory=list)  # index j: drafts that proposed a token j
    num_requests_switched_off: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposers: dict[str, Proposer]):
        self.config = config
        self.proposers = proposers
        self.stats = SpecDecodeStats()
        self.method_to_seconds_per_token: dict[str, float] = {}
        self.step_seconds: float | None = None  # moving average of a step without speculation

    # ---- requests --------------------------------------------------------------------------
    def resolve(self, params) -> tuple[str | None, int]:
        """(method, k) for a request's SamplingParams; raises InvalidRequestError for a method
        this server cannot run or a k above its --num-speculative-tokens."""
        choice = params.speculative
        method = self.config.method
        num_tokens = self.config.num_speculative_tokens
        if choice is not None:
            if choice.method != "default":
                method = choice.method
            if choice.num_tokens is not None:
                if choice.num_tokens > self.config.num_speculative_tokens:
                    raise InvalidRequestError(
                        f"speculative.num_tokens must be in [1, {self.config.num_speculative_tokens}] (the server's "
                        f"--num-speculative-tokens), got {choice.num_tokens}", param="speculative.num_tokens")
                num_tokens = choice.num_tokens
        if method is not None and method not in self.proposers:
            raise InvalidRequestError(
                f"speculative.method {method!r} is not available on this server (available: "
                f"{sorted(self.proposers)}); draft_model needs the server started with --draft-model",
                param="speculative.method")
        return method, num_tokens

    def admit(self, request: Request) -> None:
        """Decide at arrival whether the request speculates, and with which method and k."""
        params = request.sampling_params
        method, num_tokens = self.resolve(params)
        if method is None:
            return
        request.spec_state = RequestSpecState(method, num_tokens)
        request.num_speculative_tokens = num_tokens

    # ---- one step ----------------------------------------------------------------------------
    def propose(self, scheduler_output) -> None:
        for request_id in scheduler_output.finished_request_ids:
            for proposer in self.proposers.values():
                proposer.drop(request_id)
        method_to_scheduled: dict[str, list] = {}
        for scheduled in scheduler_output.scheduled:
            if scheduled.num_spec_slots:
                method_to_scheduled.setdefault(scheduled.request.spec_state.method, []).append(scheduled)
        for method, group in method_to_scheduled.items():
            started = time.perf_counter()
            proposals = self.proposers[method].propose([s.request for s in group], [s.num_spec_slots for s in group],
                                                       [s.block_tables for s in group])
            seconds = time.perf_counter() - started
            num_proposed = 0
            for scheduled, token_ids in zip(group, proposals):
                token_ids = token_ids[:scheduled.num_spec_slots]
                if scheduled.request.grammar is not None:
                    # Under a grammar only the proposals it accepts are worth verifying: the target
                    # distribution gives the others probability zero.
                    token_ids = scheduled.request.grammar.valid_prefix(token_ids)
                scheduled.request.spec_token_ids = token_ids
                scheduled.num_new_tokens = 1 + len(token_ids)
                num_proposed += max(scheduled.num_spec_slots, 1)
            self._average(self.method_to_seconds_per_token, method, seconds / num_proposed)

    def observe(self, scheduler_output, sampled_token_ids: dict[str, list[int]], step_seconds: float) -> None:
        """After Scheduler.update: statistics, adaptive k, rollback notice to the proposers."""
        has_speculation = False
        for scheduled in scheduler_output.scheduled:
            if not scheduled.num_spec_slots:
                continue
            has_speculation = True
            request = scheduled.request
            state: RequestSpecState = request.spec_state
            self.proposers[state.method].on_verified(request)
            num_proposed = scheduled.num_new_tokens - 1
            if num_proposed == 0:
                continue
            emitted = sampled_token_ids.get(request.request_id, [])
            num_accepted = max(0, min(len(emitted) - 1, num_proposed))
            self._record(state, num_proposed, num_accepted, len(emitted))
            if self.config.enable_adaptive and not request.is_finished:
                self._adapt(request, state)
        if not has_speculation:
            self.step_seconds = step_seconds if self.step_seconds is None else (
                (1 - TIMING_WEIGHT) * self.step_seconds + TIMING_WEIGHT * step_seconds)

    def _record(self, state: RequestSpecState, num_proposed: int, num_accepted: int, num_emitted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_proposed
        stats.num_accepted_tokens += num_accepted
        stats.num_emitted_tokens += num_emitted
        while len(stats.drafts_per_position) < num_proposed:
            stats.drafts_per_position.append(0)
            stats.accepted_per_position.append(0)
        for position in range(num_proposed):
            stats.drafts_per_position[position] += 1
            stats.accepted_per_position[position] += position < num_accepted
        state.num_verifications += 1
        state.num_draft_tokens += num_proposed
        state.num_accepted_tokens += num_accepted
        # Positions tried: up to and including the first rejection.
        state.num_tried += min(num_accepted + 1, num_proposed)
        state.num_accepted += num_accepted

    def cost(self, method: str) -> float:
        """c: a proposed token's cost relative to a plain decode step (draft + verify row)."""
        draft_seconds = self.method_to_seconds_per_token.get(method, 0.0)
        relative = draft_seconds / self.step_seconds if self.step_seconds else 0.0
        return relative + self.config.verify_token_cost

    def _adapt(self, request: Request, state: RequestSpecState) -> None:
        cost = self.cost(state.method)
        acceptance = state.acceptance
        best_k, best = max(((k, expected_speedup(acceptance, k, cost)) for k in range(1, state.max_num_tokens + 1)),
                           key=lambda pair: pair[1])
        if best < 1.0 and state.num_verifications >= MIN_VERIFICATIONS_BEFORE_OFF:
            state.is_off = True
            request.num_speculative_tokens = 0
            self.stats.num_requests_switched_off += 1
            return
        request.num_speculative_tokens = best_k

    @staticmethod
    def _average(averages: dict[str, float], key: str, value: float) -> None:
        previous = averages.get(key)
        averages[key] = value if previous is None else (1 - TIMING_WEIGHT) * previous + TIMING_WEIGHT * value
