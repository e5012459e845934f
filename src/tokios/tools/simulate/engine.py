"""The discrete-event loop: a workload, a fleet of backends and a routing policy, run to the end.

Owns `FleetSpec` (how many backends, of which ServiceModel; validated), `SimulationResult` and
`simulate(workload, fleet, policy)`. Events are of two kinds: arrivals, already sorted by time in
the Workload, and backend events (the end of a step or of a run of decode steps), one per busy
backend in a heap keyed by (time, backend id, version). The loop takes whichever comes first;
a backend event whose version is older than the backend's is one a later call replaced (an
arrival cut a run of decode steps short) and is skipped. On an arrival the router picks a
backend; on a finish the backend's load falls. Nothing else moves time, so a run costs a few
events per request whatever the fleet size (backend.py explains the runs of decode steps).
"""

from __future__ import annotations

import dataclasses
import heapq
import time

from tokios.errors import InvalidRequestError
from tokios.gateway.router import PrefixPolicy
from tokios.tools.simulate.backend import ServiceModel, SimRequest
from tokios.tools.simulate.routing import make_router
from tokios.tools.simulate.workload import Workload

MAX_BACKENDS = 100_000


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    num_backends: int
    service: ServiceModel

    def __post_init__(self) -> None:
        check_num_backends(self.num_backends)


def check_num_backends(num_backends: int) -> None:
    if not isinstance(num_backends, int) or isinstance(num_backends, bool) or not 1 <= num_backends <= MAX_BACKENDS:
        raise InvalidRequestError(f"num_backends: {num_backends!r} must be an integer within [1, {MAX_BACKENDS}]",
                                  param="num_backends")


@dataclasses.dataclass
class SimulationResult:
    policy: str
    num_backends: int
    requests: list[SimRequest]
    backend_busy_s: list[float]
    num_backend_steps: int
    num_events: int
    num_prefix_evictions: int
    wall_s: float
    router_counters: dict[str, int]

    @property
    def makespan_s(self) -> float:
        """From the first arrival to the last finish."""
        return max(r.finish_s for r in self.requests) - self.requests[0].arrival_s


def check_workload_fits(workload: Workload, service: ServiceModel) -> None:
    """Every request must fit one backend's context and KV cache on its own (else it would wait forever)."""
    if not service.is_batching:
        return
    cost, block_size = service.cost, service.limits.block_size
    longest = max(p + o for p, o in zip(workload.prompt_lens, workload.output_lens))
    if longest > cost.model.max_context_len:
        raise InvalidRequestError(
            f"prompt_len: a request of {longest:,} tokens (prompt + output) exceeds {cost.model.name}'s context "
            f"of {cost.model.max_context_len:,}; shorten --prompt-len / --output-len or cap the lognormal with :MAX",
            param="prompt_len")
    capacity_tokens = cost.kv_capacity_tokens // block_size * block_size
    if -(-longest // block_size) * block_size > capacity_tokens:
        raise InvalidRequestError(
            f"prompt_len: a request of {longest:,} tokens (prompt + output) does not fit one backend's KV cache "
            f"of {capacity_tokens:,} tokens", param="prompt_len")


def simulate(workload: Workload, fleet: FleetSpec, policy: str, *,
             prefix_options: PrefixPolicy = PrefixPolicy(), seed: int = 0) -> SimulationResult:
    started = time.perf_counter()
    check_workload_fits(workload, fleet.service)
    num_backends = fleet.num_backends
    loads = [0] * num_backends
    shared_prefix_len = workload.spec.shared_prefix_len if workload.spec.uses_shared_prefixes else 0
    router = make_router(policy, loads, cacheable_prefix_len=fleet.service.cacheable_prefix_len(shared_prefix_len),
                         prefix_options=prefix_options)
    on_prefix_evicted = getattr(router, "on_prefix_evicted", None)
    backends = [fleet.service.make_backend(b, shared_prefix_len=shared_prefix_len, seed=seed,
                                           on_prefix_evicted=on_prefix_evicted) for b in range(num_backends)]
    requests = [SimRequest(i, arrival, prompt_len, output_len, prefix_id)
                for i, (arrival, prompt_len, output_len, prefix_id) in enumerate(zip(
                    workload.arrival_s, workload.prompt_lens, workload.output_lens, workload.prefix_ids))]

    events: list[tuple[float, int, int]] = []  # (time, backend id, version)
    num_requests = len(requests)
    next_arrival = 0
    num_events = 0
    choose, on_load_change = router.choose, router.on_load_change
    while next_arrival < num_requests or events:
        num_events += 1
        if events and (next_arrival >= num_requests or events[0][0] <= requests[next_arrival].arrival_s):
            now, backend_id, version = heapq.heappop(events)
            backend = backends[backend_id]
            if version != backend.version:
                continue
            finished, next_event_s = backend.on_event(now)
            if finished:
                loads[backend_id] -= len(finished)
                on_load_change(backend_id)
        else:
            request = requests[next_arrival]
            next_arrival += 1
            backend_id = choose(request)
            request.backend_id = backend_id
            loads[backend_id] += 1
            on_load_change(backend_id)
            backend = backends[backend_id]
            next_event_s = backend.add_request(request, request.arrival_s)
        if next_event_s is not None:
            heapq.heappush(events, (next_event_s, backend_id, backend.version))

    return SimulationResult(
        policy=policy, num_backends=num_backends, requests=requests,
        backend_busy_s=[backend.busy_s for backend in backends],
        num_backend_steps=sum(backend.num_steps for backend in backends), num_events=num_events,
        num_prefix_evictions=sum(backend.prefix_cache.num_evictions for backend in backends),
        wall_s=time.perf_counter() - started, router_counters=router.counters())
