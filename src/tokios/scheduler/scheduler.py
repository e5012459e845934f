"""The token-budget scheduler: continuous batching, chunked prefill, preemption by recompute.

Pure Python (no torch). There is no prefill/decode split: every request has
num_computed_tokens and a target (all of its token ids); a step gives each scheduled request
some new tokens to compute, under two limits (max_num_batched_tokens, max_num_seqs):

1. Running requests first: decoding ones (oldest first) get their one token, then prefilling
   ones (oldest first) the rest of their prompt, cut to the remaining budget (chunked prefill).
   When the KV pool cannot hold a running request's new tokens, the newest running request is
   preempted (blocks freed, generated tokens kept, recomputed later) and put at the head of the
   waiting queue, until the older one fits.
2. Then waiting requests, in order, while budget, sequence slots and blocks last: each starts
   from its longest cached prefix (prefix caching) or, for the extra samples of an n > 1
   request, from a fork of its parent's prompt blocks.

Fair chunked prefill: when a step carries decodes, its prefill chunks are also cut to a time
budget (max_step_s; "auto" gives prefill as much time as the step's decodes take, so a long
prompt at most doubles the other streams' inter-token latency), predicted from the measured
step times (step_cost.py: a decode step's time, and what a prompt token adds to a step at the
context it is at now). Each prefilling request still gets
at least MIN_PREFILL_CHUNK tokens a step, so a long prompt always progresses. Until the model
has seen enough steps to predict (just after start), chunks next to decodes are
CALIBRATION_CHUNK tokens. A step without decodes has no time budget: a prompt alone on the
engine prefills at full speed.

Layer slices (when the model runs a chunk through some of its layers at a time,
num_sliceable_layers): once the budget holds fewer than MIN_PREFILL_CHUNK of a prompt's tokens
(late in a long prompt, where a chunk's fixed cost, reading the weights and the context's KV, is
most of it), that prompt goes on in LAYER_SLICE_CHUNK-token chunks, each run through as many
layers a step as the budget holds (a LayerSlice), the chunk's hidden states kept by the runner
between steps. Each step then pays for part of the layers' reads, not all of them for a
few tokens. The chunk's tokens count as computed when its last layer is done; its blocks join
the prefix cache only then (before, some layers' K/V are not written).

update() takes the sampled tokens back, appends them, checks EOS / stop tokens / length, and
frees the blocks of finished requests.

Speculative decoding: a decoding request whose num_speculative_tokens > 0 gets room for its
last token plus up to that many proposed tokens (num_spec_slots), when the budget, the pool,
max_tokens and the context allow; if the pool cannot hold them it falls back to a plain decode
before anyone is preempted. After verification update() rolls the rejected positions back
(num_computed_tokens truncated, blocks past it freed).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from tokios.kv_cache.manager import KVCacheManager
from tokios.request import Request, RequestStatus
from tokios.scheduler.step_cost import StepCostModel

# The fewest prompt tokens a prefilling request gets in a step that has a time budget: the floor
# that keeps a long prompt moving when the budget holds fewer. Late in a long prompt the floor is
# what a step carries, so it sets the other streams' p99. A chunk's cost late in the prompt is
# mostly reading its context's KV once per step (at 4,500 tokens of context on 2 cores one token
# adds 16 ms to a 27 ms step, four 25 ms, eight 50 ms), so above 4 tokens the streams' p99 grows
# with the floor (`tokios bench fairness`, --max-step-ms auto: 8 tokens about 3x the p99 before
# the prompt, 4 tokens about 2x) and below 4 the step barely shrinks while the prompt slows
# (2 tokens: the same ratio within the host's noise, a later first token).
MIN_PREFILL_CHUNK = 4
# A prompt chunk run through the layers over several steps (layer slices). Larger chunks share
# the fixed cost of a pass more widely, but even one layer of the chunk must fit a step.
LAYER_SLICE_CHUNK = 32
# A prefill chunk next to decodes while the cost model cannot predict yet: small enough not to
# stall the streams, large enough to teach the model the per-row cost.
CALIBRATION_CHUNK = 32
# max_step_s value: prefill gets as much time as the step's decodes (a step at most doubles).
AUTO_STEP_BUDGET = "auto"


@dataclass(frozen=True)
class LayerSlice:
    """The layers [start, stop) of num_layers a prompt chunk runs through this step."""

    start: int
    stop: int
    num_layers: int

    @property
    def is_last(self) -> bool:
        return self.stop == self.num_layers

    @property
    def fraction(self) -> float:
        return (self.stop - self.start) / self.num_layers


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_tables: list[list[int]]  # one per KV group (kv_cache/layout.py)
    # Room reserved for proposed tokens (speculative decoding); the speculator fills
    # request.spec_token_ids with at most this many and sets num_new_tokens = 1 + their count.
    num_spec_slots: int = 0
    # A prompt chunk run through only some layers this step (None: all of them).
    layer_slice: LayerSlice | None = None

    @property
    def is_prefill(self) -> bool:
        """A chunk of known tokens, not a decode (one new token, or a verify of proposals)."""
        return self.request.num_tokens - self.request.num_computed_tokens > 1

    @property
    def computes_tokens(self) -> bool:
        """Does this step finish its tokens (every layer), so they count as computed?"""
        return self.layer_slice is None or self.layer_slice.is_last

    @property
    def samples_this_step(self) -> bool:
        """Does this step reach the request's last known token (so its logits are sampled)?"""
        return self.computes_tokens and self.request.num_computed_tokens + self.num_new_tokens >= self.request.num_tokens

    @property
    def prefill_work(self) -> float:
        """Prompt tokens this step, each weighted by the share of the layers it runs through."""
        if not self.is_prefill:
            return 0.0
        return self.num_new_tokens * (1.0 if self.layer_slice is None else self.layer_slice.fraction)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Requests that left the engine since the last step: the runner drops their state.
    finished_request_ids: list[str] = field(default_factory=list)
    # The disk tier (kv_cache/manager.py take_transfers): cached blocks evicted this step, whose
    # bytes go to disk before the step runs, then blocks read from disk, written into the cache.
    block_spills: list[tuple[int, object]] = field(default_factory=list)
    block_loads: list[tuple[int, object, bytes]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt tokens (or tokens recomputed after a preemption) in the step; valid until update()."""
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def prefill_work(self) -> float:
        """num_prefill_tokens with each token weighted by the share of the layers it runs through."""
        return sum(s.prefill_work for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class FinishedRequest:
    request: Request
    status: RequestStatus


class PrefillAllowance:
    """The time a step's prefill chunks may still take: unlimited (no decodes, or no budget),
    calibrating (a budget but no estimate yet) or seconds under the step cost model."""

    def __init__(self, cost: StepCostModel | None, seconds: float):
        self.cost = cost  # None: unlimited
        self.seconds = seconds

    @classmethod
    def unlimited(cls) -> "PrefillAllowance":
        return cls(None, math.inf)

    @property
    def is_unlimited(self) -> bool:
        return self.cost is None

    def chunk(self, num_new: int) -> int:
        """num_new prompt tokens cut to what the allowance holds."""
        if self.cost is None or num_new <= MIN_PREFILL_CHUNK:
            return num_new
        if not self.cost.is_calibrated:
            return min(num_new, CALIBRATION_CHUNK)
        return min(num_new, max(MIN_PREFILL_CHUNK, self.cost.max_prefill_tokens(self.seconds)))

    def holds_floor(self) -> bool:
        """Does the allowance hold MIN_PREFILL_CHUNK whole-model prompt tokens (or is unknown)?"""
        if self.cost is None or not self.cost.is_calibrated:
            return True
        return self.cost.max_prefill_tokens(self.seconds) >= MIN_PREFILL_CHUNK

    def layers(self, num_tokens: int, start: int, num_layers: int) -> LayerSlice:
        """The layers from `start` that num_tokens prompt tokens may run through: as many as the
        allowance holds, at least one, all the rest when it is unlimited or not calibrated."""
        stop = num_layers
        if self.cost is not None and self.cost.is_calibrated:
            layer_seconds = num_tokens * self.cost.seconds_per_prefill_token / num_layers
            stop = min(num_layers, start + max(1, int(self.seconds / layer_seconds)))
        return LayerSlice(start, stop, num_layers)

    def spend(self, num_tokens: float) -> None:
        if self.cost is not None and self.cost.is_calibrated:
            self.seconds -= num_tokens * self.cost.seconds_per_prefill_token


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_step_s: float | str | None = None, num_sliceable_layers: int | None = None):
        """max_step_s: a step's time budget when it carries decodes: seconds, AUTO_STEP_BUDGET, or
        None (the token budget alone). num_sliceable_layers: the model's layer count when the
        runner can run a prompt chunk through some layers at a time (layer slices), else None."""
        self.kv = kv_manager
        self.max_step_s = max_step_s
        self.num_sliceable_layers = num_sliceable_layers
        # Requests whose prompt goes on in layer slices: (the chunk's tokens, layers it has done),
        # (0, 0) between chunks.
        self._slicing: dict[str, tuple[int, int]] = {}
        self.step_cost = StepCostModel()
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
        self._slicing.pop(request_id, None)
        self._finished_since_last_step.append(request_id)
        return request

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(finished_request_ids=self._finished_since_last_step)
        self._finished_since_last_step = []
        budget = self.max_num_batched_tokens
        now = time.monotonic()

        decoding = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        allowance = PrefillAllowance.unlimited()
        reached_prefills = False
        for request in decoding + prefilling:
            if budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            is_prefill = request.num_tokens - request.num_computed_tokens != 1
            if is_prefill and not reached_prefills:
                reached_prefills = True
                allowance = self._prefill_allowance(output)
            available = min(request.num_tokens - request.num_computed_tokens, budget)
            layer_slice = None
            if is_prefill and self.num_sliceable_layers is not None:
                num_new, layer_slice = self._sliced_chunk(request, available, allowance)
                if num_new == 0:
                    continue  # its chunk does not fit the token budget left this step
            else:
                num_new = allowance.chunk(available)
            num_spec = self._num_spec_slots(request, num_new, budget)
            register = layer_slice is None or layer_slice.is_last
            copies = self.kv.allocate_slots(request, num_new + num_spec) if num_spec else None
            if copies is None:
                num_spec = 0
                copies = self.kv.allocate_slots(request, num_new, register_blocks=register)
            while copies is None:
                victim = self.running[-1]
                self._preempt(victim, output)
                if victim is request:
                    break
                copies = self.kv.allocate_slots(request, num_new, register_blocks=register)
            if copies is None:
                break  # the request preempted itself: nothing older can be helped either
            output.block_copies.extend(copies)
            scheduled = ScheduledRequest(request, num_new + num_spec, self.kv.block_tables(request.request_id),
                                         num_spec, layer_slice)
            output.scheduled.append(scheduled)
            budget -= num_new + num_spec
            allowance.spend(scheduled.prefill_work)

        if not output.preempted_request_ids:
            if not reached_prefills:
                allowance = self._prefill_allowance(output)
            self._admit_waiting(output, budget, now, allowance)
        output.block_spills, output.block_loads = self.kv.take_transfers()
        return output

    def _sliced_chunk(self, request: Request, available: int,
                      allowance: "PrefillAllowance") -> tuple[int, LayerSlice | None]:
        """A running prompt's chunk this step and its layers (None: all), for a model that can
        run layer slices. A chunk part-way through the layers goes on with the same tokens (0
        tokens when they do not fit the token budget left); a prompt whose budget no longer
        holds MIN_PREFILL_CHUNK tokens goes on in layer slices for the rest of it, except in
        steps without a time budget (no decodes), where chunks are whole again."""
        progress = self._slicing.get(request.request_id)
        if progress is None:
            if allowance.holds_floor() or available <= MIN_PREFILL_CHUNK:
                return allowance.chunk(available), None
            progress = (0, 0)
        num_tokens, layers_done = progress
        if layers_done == 0:
            if allowance.is_unlimited:
                return allowance.chunk(available), None
            num_tokens = min(available, LAYER_SLICE_CHUNK)
        elif num_tokens > available:
            return 0, None
        self._slicing[request.request_id] = (num_tokens, layers_done)
        return num_tokens, allowance.layers(num_tokens, layers_done, self.num_sliceable_layers)

    def _prefill_allowance(self, output: SchedulerOutput) -> "PrefillAllowance":
        """What the step's prefill chunks may add, given the decodes scheduled so far."""
        if self.max_step_s is None or not output.scheduled:
            return PrefillAllowance.unlimited()
        decode_s = self.step_cost.decode_s or 0.0
        return PrefillAllowance(self.step_cost, decode_s if self.max_step_s == AUTO_STEP_BUDGET
                                else self.max_step_s - decode_s)

    def observe_step(self, output: SchedulerOutput, seconds: float, layer_slice_seconds: float = 0.0) -> None:
        """The measured time of the step that ran `output` (feeds the step cost model), and of
        its layer slices' own forwards within it. Call it before update(), while
        num_computed_tokens still describe the step. Timed apart, the slices teach the model the
        prompt's cost and the rest of the step the decodes' (which grow with the streams'
        context while a long prompt is prefilled: a decode-only step may not come for minutes)."""
        num_decode_rows = sum(s.num_new_tokens for s in output.scheduled if not s.is_prefill)
        sliced_work = sum(s.prefill_work for s in output.scheduled if s.layer_slice is not None)
        if sliced_work > 0 and layer_slice_seconds > 0:
            self.step_cost.observe(0, sliced_work, layer_slice_seconds)
            seconds -= layer_slice_seconds
        self.step_cost.observe(num_decode_rows, output.prefill_work - sliced_work, seconds)

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
        if any(s.request is request for s in output.scheduled):
            self.kv.uncache_uncomputed(request)  # its blocks for this step's tokens stay unwritten
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self._slicing.pop(request.request_id, None)  # its chunk starts again from the first layer
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_request_ids.append(request.request_id)
        # A request scheduled earlier in this step may be the victim: unschedule it.
        output.scheduled = [s for s in output.scheduled if s.request is not request]

    def _admit_waiting(self, output: SchedulerOutput, budget: int, now: float, allowance: "PrefillAllowance") -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            parent = request.parent
            if parent is not None and not parent.is_finished and (
                    parent.status != RequestStatus.RUNNING or parent.num_computed_tokens < parent.num_prompt_tokens):
                skipped.append(request)  # its parent's prompt is not computed yet: fork later
                continue
            copies, num_new = self._admit(request, budget, parent, allowance)
            if copies is None:
                self.waiting.appendleft(request)
                break
            output.block_copies.extend(copies)
            output.scheduled.append(ScheduledRequest(request, num_new, self.kv.block_tables(request.request_id)))
            budget -= num_new
            allowance.spend(num_new)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self.running.append(request)
        self.waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, budget: int, parent: Request | None,
               allowance: "PrefillAllowance") -> tuple[list[tuple[int, int]] | None, int]:
        """Blocks for a waiting request's first chunk: (copy-on-write pairs or None when the pool
        cannot hold it, the chunk's token count)."""
        if parent is not None and not parent.is_finished and request.num_output_tokens == 0:
            # n > 1: share the parent's prompt blocks and recompute only the last prompt token
            # (this sample's own logits); that write is copied on write.
            self.kv.fork(parent, request, request.num_prompt_tokens)
            request.num_computed_tokens = request.num_prompt_tokens - 1
            copies = self.kv.allocate_slots(request, 1)
            if copies is None:
                self.kv.free(request)
                request.num_computed_tokens = 0
            return copies, 1
        computed_blocks, num_cached = [], 0
        # Prompt logprobs and pooled embeddings need every prompt position's hidden state, so such
        # a request computes its whole prompt (its blocks still join the cache for others).
        params = request.sampling_params
        if params.prompt_logprobs is None and params.pooling is None:
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
        if self.running and not self._whole_prompt_fits(request, computed_blocks, num_cached):
            return None, 0
        num_new = allowance.chunk(min(request.num_tokens - num_cached, budget))
        copies = self.kv.allocate_slots(request, num_new, computed_blocks, num_hit_tokens=num_cached)
        if copies is not None:
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
        return copies, num_new

    def _whole_prompt_fits(self, request: Request, computed_blocks: list[list[int]], num_cached: int) -> bool:
        """Admission by whole prompts: a request starts only when the free blocks hold the rest
        of its prompt as well as the rest of every running request's prompt. Admitting by first
        chunk alone let every waiting request in; their prompts then outgrew the pool and each
        other's blocks went to preemption and recompute (bench capacity: 7 requests of 4,096
        tokens running in room for 2, 226 ms a token). A request alone on the engine always
        starts (make_requests refused any that can never fit)."""
        reserved = sum(max(0, self.kv.free_blocks_to_hold(r))
                       for r in self.running if r.num_computed_tokens < r.num_tokens - 1)
        return self.kv.free_blocks_to_hold(request, computed_blocks, num_cached) + reserved <= self.kv.num_free_blocks

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> list[FinishedRequest]:
        """Advance computed counts, append sampled tokens, finish requests that ended."""
        finished = []
        for scheduled in output.scheduled:
            request = scheduled.request
            if scheduled.layer_slice is not None:
                if not scheduled.layer_slice.is_last:
                    self._slicing[request.request_id] = (scheduled.num_new_tokens, scheduled.layer_slice.stop)
                    continue
                self._slicing[request.request_id] = (0, 0)
            request.num_computed_tokens += scheduled.num_new_tokens
            if request.num_tokens - request.num_computed_tokens <= 1:
                self._slicing.pop(request.request_id, None)  # its prompt is done
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
