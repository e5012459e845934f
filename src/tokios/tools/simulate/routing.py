"""Routing policies: which backend of the fleet a new request goes to.

Owns `LoadHeap` (the least or most loaded of a set of backends in O(log n), lazily updated),
the three routers and `make_router(policy, ...)`. A backend's load is its number of unfinished
requests (waiting or running), the in-flight count that least-busy gateways balance; engine.py
owns the `loads` list, changes it on every arrival and finish and then calls
`on_load_change(backend_id)`.

- round robin ("rr"): backends in turn.
- least-busy ("least-busy"): the backend with the fewest unfinished requests (ties: lowest id).
- prefix-aware ("prefix"): SGLang's cache-aware router, with the gateway's own thresholds and
  imbalance test (gateway/router.py PrefixPolicy). When the fleet is imbalanced (the
  busiest backend has more than `balance_abs_threshold` requests more than the idlest and more
  than `balance_rel_threshold` times its load) it routes least-busy. Otherwise a request whose
  cached system prompt covers at least `cache_threshold` of its prompt goes to the least loaded
  backend holding that prefix; anything else goes least-busy. Like SGLang's router, it keeps its
  own map of what it has sent where (prefix id -> backends), and forgets a backend when that
  backend evicts the prefix.

Why heaps (scale): with 10,000 backends a linear scan per request would dominate the run; each
load change pushes one entry, stale entries are skipped when they reach the top.
"""

from __future__ import annotations

import heapq

from tokios.errors import InvalidRequestError
from tokios.gateway.router import PrefixPolicy
from tokios.tools.simulate.workload import NO_PREFIX

POLICY_NAMES = ("rr", "least-busy", "prefix")
POLICY_ALIASES = {"round-robin": "rr", "least-loaded": "least-busy", "prefix-aware": "prefix"}


def parse_policies(text: str) -> list[str]:
    """'rr,least-busy,prefix' -> the policy names, in order, without repeats."""
    names = []
    for part in str(text).split(","):
        name = POLICY_ALIASES.get(part.strip().lower(), part.strip().lower())
        if name not in POLICY_NAMES:
            raise InvalidRequestError(
                f"policies: unknown policy {part.strip()!r}; choose from {', '.join(POLICY_NAMES)}", param="policies")
        if name not in names:
            names.append(name)
    return names


class LoadHeap:
    """The least (or, with `largest`, the most) loaded member; ties go to the lowest id.
    Invariant: every member has an entry keyed by its current load; others are stale."""

    def __init__(self, loads: list[int], members=(), *, largest: bool = False):
        self.loads = loads
        self.sign = -1 if largest else 1
        self.members = set(members)
        self.heap = [(self.sign * loads[b], b) for b in self.members]
        heapq.heapify(self.heap)

    def add(self, backend_id: int) -> None:
        if backend_id not in self.members:
            self.members.add(backend_id)
            heapq.heappush(self.heap, (self.sign * self.loads[backend_id], backend_id))

    def remove(self, backend_id: int) -> None:
        self.members.discard(backend_id)  # its entries go stale

    def update(self, backend_id: int) -> None:
        if backend_id in self.members:
            heapq.heappush(self.heap, (self.sign * self.loads[backend_id], backend_id))
            if len(self.heap) > 4 * len(self.members) + 1024:
                self.heap = [(self.sign * self.loads[b], b) for b in self.members]
                heapq.heapify(self.heap)

    def top(self) -> int | None:
        heap, loads, sign, members = self.heap, self.loads, self.sign, self.members
        while heap:
            key, backend_id = heap[0]
            if backend_id in members and key == sign * loads[backend_id]:
                return backend_id
            heapq.heappop(heap)
        return None


class RoundRobinRouter:
    name = "rr"

    def __init__(self, num_backends: int):
        self.num_backends = num_backends
        self.next_backend_id = 0

    def choose(self, request) -> int:
        backend_id = self.next_backend_id
        self.next_backend_id = (backend_id + 1) % self.num_backends
        return backend_id

    def on_load_change(self, backend_id: int) -> None:
        pass

    def counters(self) -> dict[str, int]:
        return {}


class LeastBusyRouter:
    name = "least-busy"

    def __init__(self, loads: list[int]):
        self.least_loaded = LoadHeap(loads, range(len(loads)))

    def choose(self, request) -> int:
        return self.least_loaded.top()

    def on_load_change(self, backend_id: int) -> None:
        self.least_loaded.update(backend_id)

    def counters(self) -> dict[str, int]:
        return {}


class PrefixAwareRouter:
    name = "prefix"

    def __init__(self, loads: list[int], *, cacheable_prefix_len: int,
                 options: PrefixPolicy = PrefixPolicy()):
        self.loads = loads
        self.options = options
        self.cacheable_prefix_len = cacheable_prefix_len
        self.least_loaded = LoadHeap(loads, range(len(loads)))
        self.most_loaded = LoadHeap(loads, range(len(loads)), largest=True)
        self.prefix_id_to_holders: dict[int, LoadHeap] = {}
        self.backend_id_to_prefix_ids: dict[int, set[int]] = {}
        self.num_imbalanced = 0  # requests routed least-busy because the fleet was imbalanced
        self.num_prefix_routed = 0  # requests sent to a backend holding their prefix

    def is_imbalanced(self) -> bool:
        busiest = self.loads[self.most_loaded.top()]
        idlest = self.loads[self.least_loaded.top()]
        return self.options.is_imbalanced([busiest, idlest])

    def choose(self, request) -> int:
        prefix_id = request.prefix_id
        if self.is_imbalanced():
            self.num_imbalanced += 1
            backend_id = self.least_loaded.top()
        else:
            backend_id = None
            if prefix_id != NO_PREFIX and \
                    self.cacheable_prefix_len >= self.options.cache_threshold * request.prompt_len:
                holders = self.prefix_id_to_holders.get(prefix_id)
                backend_id = holders.top() if holders is not None else None
                if backend_id is not None:
                    self.num_prefix_routed += 1
            if backend_id is None:
                backend_id = self.least_loaded.top()
        if prefix_id != NO_PREFIX and self.cacheable_prefix_len > 0:
            holders = self.prefix_id_to_holders.get(prefix_id)
            if holders is None:
                holders = self.prefix_id_to_holders[prefix_id] = LoadHeap(self.loads)
            holders.add(backend_id)
            self.backend_id_to_prefix_ids.setdefault(backend_id, set()).add(prefix_id)
        return backend_id

    def on_load_change(self, backend_id: int) -> None:
        self.least_loaded.update(backend_id)
        self.most_loaded.update(backend_id)
        for prefix_id in self.backend_id_to_prefix_ids.get(backend_id, ()):
            self.prefix_id_to_holders[prefix_id].update(backend_id)

    def counters(self) -> dict[str, int]:
        return {"num_imbalanced": self.num_imbalanced, "num_prefix_routed": self.num_prefix_routed}

    def on_prefix_evicted(self, backend_id: int, prefix_id: int) -> None:
        holders = self.prefix_id_to_holders.get(prefix_id)
        if holders is not None:
            holders.remove(backend_id)
        self.backend_id_to_prefix_ids.get(backend_id, set()).discard(prefix_id)


def make_router(policy: str, loads: list[int], *, cacheable_prefix_len: int = 0,
                prefix_options: PrefixPolicy = PrefixPolicy()):
    if policy == "rr":
        return RoundRobinRouter(len(loads))
    if policy == "least-busy":
        return LeastBusyRouter(loads)
    if policy == "prefix":
        return PrefixAwareRouter(loads, cacheable_prefix_len=cacheable_prefix_len, options=prefix_options)
    raise InvalidRequestError(f"policies: unknown policy {policy!r}; choose from {', '.join(POLICY_NAMES)}",
                              param="policies")
