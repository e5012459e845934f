"""The token-budget scheduler: continuous batching, chunked prefill, preemption by recompute.

Pure Python (no torch). There is no prefill/decode split: every request has
num_computed_tokens and a target (all of its token ids); a step gives each scheduled request
some new tokens to compute, under two limits (max_num_batched_tokens, max_num_seqs):

1. Running requests first, oldest first: each gets what it still lacks (one token when
   decoding; the rest of its prompt, cut to the remaining budget, when prefilling in chunks).
   When the KV pool cannot hold a running request's new tokens, the newest running request is
   preempted (blocks freed, generated tokens kept, recomputed later) and put at the head of the
   waiting queue, until the older one fits.
2. Then waiting requests, in order, while budget, sequence slots and blocks last: each starts
   from its longest cached prefix (prefix caching) or, for the extra samples of an n > 1
   request, from a fork of its parent's prompt blocks.

update() takes the sampled tokens back, appends them, checks EOS / stop tokens / length, and
frees the blocks of finished requests.

Speculative decoding: a decoding request whose num_speculative_tokens > 0 gets room for its
last token plus up to that many proposed tokens (num_spec_slots), when the budget, the pool,
max_tokens and the context allow; if the pool cannot hold them it falls back to a plain decode
before anyone is preempted. After verification update() rolls the rejected positions back
(num_computed_tokens truncated, blocks past it freed).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokios.kv_cache.manager import KVCacheManager
from tokios.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_tables: list[list[int]]  # one per KV group (kv_cache/layout.py)
    # Room reserved for proposed tokens (speculative decoding); the speculator fills
    # request.spec_token_ids with at most this many and sets num_new_tokens = 1 + their count.
    num_spec_slots: int = 0

    @property
    def samples_this_step(self) -> bool:
        """Does this step reach the request's last known token (so its logits are sampled)?"""
        return self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class FinishedRequest:
    request: Request
    status: RequestStatus


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._finished_since_last_step: list[str] = []

    # ---- queue -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request (abort, or a stop string found by the front end); frees its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self._finished_since_last_step.append(request_id)
        return request

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            num_spec = self._num_spec_slots(request, num_new, budget)
            copies = self.kv.allocate_slots(request, num_new + num_spec) if num_spec else None
            if copies is None:
                num_spec = 0
                copies = self.kv.allocate_slots(request, num_new)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is request:
                    break
                copies = self.kv.allocate_slots(request, num_new)
            if copies is None:
                break  # the request preempted itself: nothing older can be helped either
            output.block_copies.extend(copies)
            output.scheduled.append(ScheduledRequest(request, num_new + num_spec, self.kv.block_tables(request.request_id),
                                                     num_spec))
            budget -= num_new + num_spec
            index += 1

        if not output.preempted_request_ids:
            self._admit_waiting(output, budget, now)
        return output

    def _num_spec_slots(self, request: Request, num_new: int, budget: int) -> int:
        """Proposed tokens a decoding request may verify this step: its wish, cut so the
        accepted tokens plus the bonus token never pass max_tokens or the context."""
        if request.num_speculative_tokens == 0 or num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return 0
        return max(0, min(request.num_speculative_tokens, budget - 1,
                          request.max_tokens - request.num_output_tokens - 1,
                          self.max_model_len - request.num_tokens - 1))

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_request_ids.append(request.request_id)
        # A request scheduled earlier in this step may be the victim: unschedule it.
        output.scheduled = [s for s in output.scheduled if s.request is not request]

    def _admit_waiting(self, output: SchedulerOutput, budget: int, now: float) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            parent = request.parent
            if parent is not None and not parent.is_finished and (
                    parent.status != RequestStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens):
                skipped.append(request)  # its parent's prompt is not computed yet: fork later
                continue
            copies = self._admit(request, budget, parent)
            if copies is None:
                self.waiting.appendleft(request)
                break
            output.block_copies.extend(copies)
            num_new = request.num_tokens - request.num_computed_tokens
            num_new = min(num_new, budget)
            output.scheduled.append(ScheduledRequest(request, num_new, self.kv.block_tables(request.request_id)))
            budget -= num_new
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, budget: int, parent: Request | None) -> list[tuple[int, int]] | None:
        if parent is not None and not parent.is_finished and request.num_output_tokens == 0:
            # n > 1: share the parent's prompt blocks and recompute only the last prompt token
            # (this sample's own logits); that write is copied on write.
            self.kv.fork(parent, request, request.num_prompt_tokens)
            request.num_computed_tokens = request.num_prompt_tokens - 1
            copies = self.kv.allocate_slots(request, 1)
            if copies is None:
                self.kv.free(request)
                request.num_computed_tokens = 0
            return copies
        computed_blocks, num_cached = [], 0
        # Prompt logprobs and pooled embeddings need every prompt position's hidden state, so such
        # a request computes its whole prompt (its blocks still join the cache for others).
        params = request.sampling_params
        if params.prompt_logprobs is None and params.pooling is None:
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        num_new = min(request.num_tokens - num_cached, budget)
        copies = self.kv.allocate_slots(request, num_new, computed_blocks)
        if copies is not None:
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
        return copies

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> list[FinishedRequest]:
        """Advance computed counts, append sampled tokens, finish requests that ended."""
        finished = []
        for scheduled in output.scheduled:
            request = scheduled.request
            request.num_computed_tokens += scheduled.num_new_tokens
            new_token_ids = sampled_token_ids.get(request.request_id, [])
            if scheduled.num_spec_slots:
                # new_token_ids = the accepted proposals + one bonus/correction token; the KV of
                # the rejected proposals is rolled back.
                num_rejected = len(request.spec_token_ids) - (len(new_token_ids) - 1)
                request.num_computed_tokens -= num_rejected
                request.spec_token_ids = []
                self.kv.truncate(request, request.num_computed_tokens)
            for index, token_id in enumerate(new_token_ids):
                request.append_token(token_id)
                status = request.check_stop(self.max_model_len)
                if status is not None:
                    self.finish(request.request_id, status)
                    finished.append(FinishedRequest(request, status))
                    # Tokens verified past a stop are dropped (the caller reports only these).
                    del new_token_ids[index + 1:]
                    break
        return finished

    def check_invariants(self) -> None:
        self.kv.check_invariants(expect_idle=not self.requests)
