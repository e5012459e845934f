"""One simulated backend: a continuous-batching engine, or an exponential single server.

Owns `SimRequest` (a request's state during one simulation), `BackendLimits` (validated:
max_num_seqs, max_num_batched_tokens, block size, the step time budget, prefix caching; the
defaults are `tokios serve`'s own), `ServiceModel` (which kind of backend a fleet is made of)
and the two backends. engine.py drives them with two calls: `add_request(request, now)` and
`on_event(now)`, each returning the time of the backend's next event (or None); a backend bumps
`version` whenever it schedules one, so the engine drops events that a later call replaced.

`BatchingBackend` follows the tokios scheduler (scheduler/scheduler.py): a step serves the
running requests first (every decoding one a token, then the prefilling ones a chunk of their
prompt under the token budget: chunked prefill), then admits waiting requests in order while
budget, sequence slots and KV blocks last; an admitted request skips the blocks of its system
prompt when the prefix cache holds it. With `max_step_s`, a step that carries decodes cuts its
prefill chunks so its predicted time stays within the budget (at least MIN_PREFILL_CHUNK tokens
each), as `tokios serve --max-step-ms` does. The step's time comes from cost_model.py.
When nothing can change a batch of decodes before its first request finishes (no prompt in
flight, nobody admissible), the backend runs them as one `DecodeRun` event of k steps; an arrival
cuts the run after the step in progress, because the newcomer may join the next step.

Admission reserves a request's whole prompt and output in KV blocks (less the cached prefix), so
no request is ever preempted: the real scheduler admits on the prompt alone and preempts by
recompute when decodes outgrow the pool. The simulator is therefore conservative when the KV
cache is the limit, and models no recompute.

`ExponentialServer` serves one request at a time, FIFO, with exponential service times: an M/M/1
queue under Poisson arrivals, whose closed forms test the event loop (tests/unit/test_simulate.py).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import deque
from typing import Callable

from tokios.config import CacheConfig, SchedulerConfig
from tokios.errors import InvalidRequestError
from tokios.scheduler.scheduler import MIN_PREFILL_CHUNK
from tokios.tools.simulate.cost_model import BackendCostModel, DecodeRun
from tokios.tools.simulate.prefix_cache import PrefixCache
from tokios.tools.simulate.workload import NO_PREFIX


class SimRequest:
    """A request as one simulation sees it. Times in seconds from the start."""

    __slots__ = ("request_id", "arrival_s", "prompt_len", "output_len", "prefix_id", "backend_id",
                 "num_computed", "num_output", "num_cached", "num_private_blocks", "is_prefix_pinned",
                 "admitted_s", "first_token_s", "finish_s")

    def __init__(self, request_id: int, arrival_s: float, prompt_len: int, output_len: int, prefix_id: int):
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.prefix_id = prefix_id
        self.backend_id = -1
        self.num_computed = 0  # prompt tokens in the KV cache (cached prefix included)
        self.num_output = 0
        self.num_cached = 0  # prompt tokens a prefix-cache hit skipped
        self.num_private_blocks = 0  # KV blocks reserved for this request alone
        self.is_prefix_pinned = False  # holds a pin on its system prompt in the prefix cache
        self.admitted_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None


_SCHEDULER_DEFAULTS = SchedulerConfig()
_CACHE_DEFAULTS = CacheConfig()


@dataclasses.dataclass(frozen=True)
class BackendLimits:
    max_num_seqs: int = _SCHEDULER_DEFAULTS.max_num_seqs
    max_num_batched_tokens: int = _SCHEDULER_DEFAULTS.max_num_batched_tokens
    block_size: int = _CACHE_DEFAULTS.block_size
    max_step_s: float | None = None  # a step's time budget when it carries decodes; None: tokens only
    enable_prefix_caching: bool = _CACHE_DEFAULTS.enable_prefix_caching

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1, 1 << 20)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, self.max_num_seqs, 1 << 24,
                   why=" (at least max_num_seqs, so every running request can decode each step)")
        _check_int("block_size", self.block_size, 1, 1024)
        if self.max_step_s is not None and not (math.isfinite(self.max_step_s) and self.max_step_s > 0):
            raise InvalidRequestError(f"max_step_ms: {self.max_step_s * 1e3!r} must be > 0", param="max_step_ms")


def _check_int(field: str, value: int, low: int, high: int, *, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidRequestError(f"{field}: {value!r} must be an integer within [{low}, {high}]{why}", param=field)


class BatchingBackend:
    def __init__(self, backend_id: int, cost: BackendCostModel, limits: BackendLimits, *,
                 shared_prefix_len: int, on_prefix_evicted: Callable[[int, int], None] | None = None):
        self.backend_id = backend_id
        self.cost = cost
        self.limits = limits
        self.num_capacity_blocks = cost.kv_capacity_tokens // limits.block_size
        self.num_private_blocks = 0
        # Only whole blocks of a system prompt are cached (a block is hashed once it is full).
        self.num_prefix_blocks = shared_prefix_len // limits.block_size if limits.enable_prefix_caching else 0
        on_evict = None if on_prefix_evicted is None else (lambda prefix_id: on_prefix_evicted(backend_id, prefix_id))
        self.prefix_cache = PrefixCache(on_evict)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []  # in admission order
        self.version = 0
        self.busy_s = 0.0
        self.num_steps = 0
        # The activity in progress: a DecodeRun of run_num_steps steps over decode_rows, or one
        # step of decode_rows plus prefill_chunks [(request, num_tokens)].
        self.activity_start_s: float | None = None  # None: idle
        self.activity_end_s = 0.0
        self.decode_run: DecodeRun | None = None
        self.run_num_steps = 0
        self.decode_rows: list[SimRequest] = []
        self.prefill_chunks: list[tuple[SimRequest, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.num_capacity_blocks - self.num_private_blocks - self.prefix_cache.num_cached_blocks

    # ---- the engine's two calls ----------------------------------------------------------------
    def add_request(self, request: SimRequest, now: float) -> float | None:
        self.waiting.append(request)
        if self.activity_start_s is None:
            return self._start_activity(now)
        if self.decode_run is None or self.run_num_steps <= 1:
            return None  # one step in flight: the newcomer is considered when it ends
        # A run's blocks and slots stay as they are until it ends (admission reserved them), so
        # whether the newcomer could join the next step is known now.
        if not self._can_admit_next(len(self.decode_rows)):
            return None
        steps_done = self.decode_run.steps_done_by(now - self.activity_start_s, self.run_num_steps)
        cut_num_steps = steps_done + 1  # the step in progress finishes first
        if cut_num_steps >= self.run_num_steps:
            return None
        self.run_num_steps = cut_num_steps
        self.activity_end_s = self.activity_start_s + self.decode_run.elapsed_s(cut_num_steps)
        self.version += 1
        return self.activity_end_s

    def on_event(self, now: float) -> tuple[list[SimRequest], float | None]:
        """The activity in progress ends at `now`: apply it, then start the next."""
        finished = self._finish_activity(now)
        return finished, self._start_activity(now)

    # ---- planning --------------------------------------------------------------------------------
    def _start_activity(self, now: float) -> float | None:
        decoding, prefilling = [], []
        for request in self.running:
            (decoding if request.num_computed >= request.prompt_len else prefilling).append(request)
        total_context = sum(request.prompt_len + request.num_output for request in decoding)
        self.decode_rows = decoding
        self.prefill_chunks = []
        if not prefilling and not self._can_admit_next(len(decoding)):
            if not decoding:
                self.activity_start_s = None
                return None
            self.decode_run = DecodeRun(self.cost, len(decoding), total_context)
            self.run_num_steps = min(request.output_len - request.num_output for request in decoding)
            seconds = self.decode_run.elapsed_s(self.run_num_steps)
        else:
            self.decode_run = None
            seconds = self._plan_step(now, decoding, prefilling, total_context)
        self.activity_start_s = now
        self.activity_end_s = now + seconds
        self.version += 1
        return self.activity_end_s

    def _plan_step(self, now: float, decoding: list[SimRequest], prefilling: list[SimRequest],
                   total_context: int) -> float:
        """One step: decodes, prefill chunks, admissions. Returns its time in seconds."""
        cost, limits = self.cost, self.limits
        budget = limits.max_num_batched_tokens - len(decoding)
        decode_flops, num_bytes = cost.decode_work(len(decoding), total_context)
        prefill_flops = 0.0
        is_time_bound = limits.max_step_s is not None and bool(decoding)
        candidates = list(prefilling)
        while True:
            for request in candidates:
                if budget <= 0:
                    break
                num_tokens = min(request.prompt_len - request.num_computed, budget)
                if is_time_bound and num_tokens > MIN_PREFILL_CHUNK:
                    num_tokens = self._fit_chunk_in_time(request, num_tokens, decode_flops, prefill_flops, num_bytes,
                                                         limits.max_num_batched_tokens - budget)
                chunk_flops, chunk_bytes = cost.prefill_chunk_work(
                    num_tokens, request.num_computed, request.num_computed + num_tokens == request.prompt_len)
                prefill_flops += chunk_flops
                num_bytes += chunk_bytes
                budget -= num_tokens
                self.prefill_chunks.append((request, num_tokens))
            if budget <= 0 or not self._admit_next(now):
                break
            candidates = [self.running[-1]]  # the newly admitted request gets its first chunk
        return cost.step_seconds(decode_flops, prefill_flops, num_bytes, limits.max_num_batched_tokens - budget)

    def _fit_chunk_in_time(self, request: SimRequest, num_tokens: int, decode_flops: float, prefill_flops: float,
                           num_bytes: float, num_step_tokens: int) -> int:
        """The most prompt tokens (at least MIN_PREFILL_CHUNK) the step of `num_step_tokens` tokens
        so far can add within max_step_s."""
        cost, max_step_s = self.cost, self.limits.max_step_s

        def fits(count: int) -> bool:
            chunk_flops, chunk_bytes = cost.prefill_chunk_work(
                count, request.num_computed, request.num_computed + count == request.prompt_len)
            return cost.step_seconds(decode_flops, prefill_flops + chunk_flops, num_bytes + chunk_bytes,
                                     num_step_tokens + count) <= max_step_s

        low, high = MIN_PREFILL_CHUNK, num_tokens
        if fits(high):
            return high
        while low < high - 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        return low

    # ---- admission and the KV blocks -------------------------------------------------------------
    def _blocks_for(self, request: SimRequest) -> tuple[int, int]:
        """(blocks a cached system prompt would give this request, blocks it must reserve)."""
        block_size = self.limits.block_size
        total = -(-(request.prompt_len + request.output_len) // block_size)
        hit = self.prefix_cache.num_blocks(request.prefix_id) if request.prefix_id != NO_PREFIX else 0
        return hit, total - hit

    def _can_admit_next(self, num_decoding: int) -> bool:
        if not self.waiting or len(self.running) >= self.limits.max_num_seqs \
                or num_decoding >= self.limits.max_num_batched_tokens:
            return False
        request = self.waiting[0]
        hit, needed = self._blocks_for(request)
        available = self.num_free_blocks + self.prefix_cache.num_evictable_blocks
        if hit and self.prefix_cache.is_evictable(request.prefix_id):
            available -= hit  # the hit pins those blocks: they cannot be evicted for it
        return needed <= available

    def _admit_next(self, now: float) -> bool:
        """Move the first waiting request to running if a slot and its blocks are free."""
        if not self._can_admit_next(0):
            return False
        request = self.waiting.popleft()
        hit, needed = self._blocks_for(request)
        if hit:
            self.prefix_cache.pin(request.prefix_id)
            request.is_prefix_pinned = True
            request.num_cached = request.num_computed = hit * self.limits.block_size
        shortfall = needed - self.num_free_blocks
        if shortfall > 0:
            self.prefix_cache.evict(shortfall)
        self.num_private_blocks += needed
        request.num_private_blocks = needed
        request.admitted_s = now
        self.running.append(request)
        return True

    # ---- applying what an activity did -------------------------------------------------------
    def _finish_activity(self, now: float) -> list[SimRequest]:
        self.busy_s += now - self.activity_start_s
        finished = []
        if self.decode_run is not None:
            num_steps = self.run_num_steps
            self.num_steps += num_steps
            for request in self.decode_rows:
                request.num_output += num_steps
                if request.num_output >= request.output_len:
                    finished.append(request)
        else:
            self.num_steps += 1
            for request in self.decode_rows:
                request.num_output += 1
                if request.num_output >= request.output_len:
                    finished.append(request)
            for request, num_tokens in self.prefill_chunks:
                request.num_computed += num_tokens
                if request.prefix_id != NO_PREFIX and not request.is_prefix_pinned:
                    self._maybe_cache_prefix(request)
                if request.num_computed == request.prompt_len:
                    request.num_output = 1  # the step that ends the prompt samples the first token
                    request.first_token_s = now
                    if request.output_len == 1:
                        finished.append(request)
        if finished:
            for request in finished:
                request.finish_s = now
                self.num_private_blocks -= request.num_private_blocks
                if request.is_prefix_pinned:
                    self.prefix_cache.unpin(request.prefix_id)
            self.running = [request for request in self.running if request.finish_s is None]
        self.activity_start_s = None
        return finished

    def _maybe_cache_prefix(self, request: SimRequest) -> None:
        """The request has computed its whole system prompt: its blocks join the prefix cache
        (moved from its reservation), unless another request cached them meanwhile."""
        num_blocks = self.num_prefix_blocks
        if num_blocks == 0 or request.num_computed < num_blocks * self.limits.block_size \
                or request.prefix_id in self.prefix_cache:
            return
        self.prefix_cache.insert(request.prefix_id, num_blocks)
        self.num_private_blocks -= num_blocks
        request.num_private_blocks -= num_blocks
        request.is_prefix_pinned = True


class ExponentialServer:
    """One request at a time, first come first served, service time ~ Exp(mean_service_s)."""

    def __init__(self, backend_id: int, mean_service_s: float, seed: int):
        self.backend_id = backend_id
        self.mean_service_s = mean_service_s
        self.rng = random.Random(f"{seed}:service:{backend_id}")
        self.waiting: deque[SimRequest] = deque()
        self.in_service: SimRequest | None = None
        self.version = 0
        self.busy_s = 0.0
        self.num_steps = 0
        self.prefix_cache = PrefixCache()  # never holds anything: no prefill to skip

    def add_request(self, request: SimRequest, now: float) -> float | None:
        self.waiting.append(request)
        return self._start_next(now) if self.in_service is None else None

    def on_event(self, now: float) -> tuple[list[SimRequest], float | None]:
        request = self.in_service
        request.first_token_s = request.finish_s = now
        request.num_output = request.output_len
        request.num_computed = request.prompt_len
        self.busy_s += now - request.admitted_s
        self.num_steps += 1
        self.in_service = None
        return [request], self._start_next(now)

    def _start_next(self, now: float) -> float | None:
        if not self.waiting:
            return None
        request = self.waiting.popleft()
        request.admitted_s = now
        self.in_service = request
        self.version += 1
        return now + self.rng.expovariate(1.0 / self.mean_service_s)


@dataclasses.dataclass(frozen=True)
class ServiceModel:
    """What every backend of a fleet is: continuous batching under `cost` and `limits`, or an
    exponential single server (`exponential_mean_s`; for queueing checks)."""

    cost: BackendCostModel | None = None
    limits: BackendLimits = BackendLimits()
    exponential_mean_s: float | None = None

    @classmethod
    def batching(cls, cost: BackendCostModel, limits: BackendLimits = BackendLimits()) -> "ServiceModel":
        return cls(cost=cost, limits=limits)

    @classmethod
    def exponential(cls, mean_service_s: float) -> "ServiceModel":
        if not (math.isfinite(mean_service_s) and mean_service_s > 0):
            raise InvalidRequestError(f"mean_service_s: {mean_service_s!r} must be > 0", param="mean_service_s")
        return cls(exponential_mean_s=mean_service_s)

    @property
    def is_batching(self) -> bool:
        return self.cost is not None

    def make_backend(self, backend_id: int, *, shared_prefix_len: int, seed: int,
                     on_prefix_evicted: Callable[[int, int], None] | None):
        if self.cost is None:
            return ExponentialServer(backend_id, self.exponential_mean_s, seed)
        return BatchingBackend(backend_id, self.cost, self.limits, shared_prefix_len=shared_prefix_len,
                               on_prefix_evicted=on_prefix_evicted)

    def cacheable_prefix_len(self, shared_prefix_len: int) -> int:
        """Tokens of a system prompt a hit skips: its whole blocks (0 without prefix caching)."""
        if self.cost is None or not self.limits.enable_prefix_caching:
            return 0
        return shared_prefix_len // self.limits.block_size * self.limits.block_size
