"""Choosing a backend for a request: session affinity, the longest cached prefix, least in-flight,
failure cool-down.

Prefix-aware routing follows SGLang's cache-aware router: when the backends' loads are even, a
request goes to the backend holding the longest part of its prompt if that is at least
`cache_threshold` of the prompt; when loads are uneven (the busiest has more than
`balance_abs_threshold` requests over the idlest and more than `balance_rel_threshold` times its
count), or no backend holds enough, to the least busy. The counts of each decision are kept
(`decision_to_count`, shown by the gateway's /status).

Sessions are keys pinned to a backend (LRU-bounded): a client's `x-session-id`, and each stored
OpenAI Responses id (`response:<id>`), so that `previous_response_id` and `GET /v1/responses/{id}`
reach the backend whose store holds that response.

Owns the table of registered backends (by stable backend id) and their health. It knows backends
only through the small `RoutableBackend` protocol, so it is unit-tested with plain objects; the
gateway app registers links (gateway/link.py) here as connectors say hello and removes them as
they go.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from tokios.errors import InvalidRequestError


class RoutableBackend(Protocol):
    backend_id: str
    models: tuple[str, ...]
    num_in_flight: int
    is_draining: bool


class PrefixMatcher(Protocol):
    """One request's prompt against what the backends hold (gateway/prefix_index.py PrefixQuery)."""

    num_prompt_tokens: int

    def num_matched_tokens(self, backend_id: str) -> int: ...


@dataclass(frozen=True)
class PrefixPolicy:
    """SGLang router's defaults."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise InvalidRequestError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}",
                                      param="cache_threshold")
        if self.balance_abs_threshold < 0:
            raise InvalidRequestError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}",
                                      param="balance_abs_threshold")
        if self.balance_rel_threshold < 1.0:
            raise InvalidRequestError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}",
                                      param="balance_rel_threshold")

    def is_imbalanced(self, loads: list[int]) -> bool:
        busiest, idlest = max(loads), min(loads)
        return busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest


class BackendRouter:
    def __init__(
        self,
        *,
        max_consecutive_failures: int = 3,
        cool_down_s: float = 30.0,
        max_sessions: int = 10_000,
        prefix_policy: PrefixPolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_consecutive_failures = max_consecutive_failures
        self.cool_down_s = cool_down_s
        self.max_sessions = max_sessions
        self.prefix_policy = prefix_policy  # None: least in-flight only
        self.decision_to_count: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._backend_id_to_backend: dict[str, RoutableBackend] = {}
        self._backend_id_to_num_failures: dict[str, int] = collections.defaultdict(int)
        self._backend_id_to_cool_until: dict[str, float] = {}
        # Ordered so the least recently used session is forgotten first.
        self._session_id_to_backend_id: collections.OrderedDict[str, str] = collections.OrderedDict()

    @property
    def backends(self) -> list[RoutableBackend]:
        return list(self._backend_id_to_backend.values())

    def add(self, backend: RoutableBackend) -> RoutableBackend | None:
        """Register `backend`; returns the backend it replaced under the same id, if any."""
        replaced = self._backend_id_to_backend.get(backend.backend_id)
        self._backend_id_to_backend[backend.backend_id] = backend
        return replaced

    def remove(self, backend: RoutableBackend) -> None:
        # Only the registered object: a stale link closing after a re-register must not
        # remove its successor.
        if self._backend_id_to_backend.get(backend.backend_id) is backend:
            del self._backend_id_to_backend[backend.backend_id]

    def models(self) -> list[str]:
        return sorted({m for b in self._backend_id_to_backend.values() if not b.is_draining for m in b.models})

    def is_cooling(self, backend_id: str) -> bool:
        return self._backend_id_to_cool_until.get(backend_id, 0.0) > self._clock()

    def pick(self, model: str, session_id: str | None = None, exclude: Iterable[str] = (),
             prefix: PrefixMatcher | None = None, owner_backend_id: str | None = None) -> RoutableBackend | None:
        """The backend for one attempt, or None when no backend serves `model`.

        `owner_backend_id`, the one backend that can answer (it stores what the request refers
        to), wins while it is connected and not draining, cooling or not. Otherwise healthy
        backends come first; cooling ones are used only when nothing else serves the model,
        since a backend that may work beats a certain 503. A session's pinned backend wins, then
        (with a prefix policy and `prefix`) the longest cached prefix, then the least busy.
        """
        excluded_ids = set(exclude)
        candidates = [
            b for b in self._backend_id_to_backend.values()
            if model in b.models and not b.is_draining and b.backend_id not in excluded_ids
        ]
        if not candidates:
            return None
        for backend in candidates:
            if backend.backend_id == owner_backend_id:
                self.decision_to_count["owner"] += 1
                return backend
        healthy = [b for b in candidates if not self.is_cooling(b.backend_id)]
        pool = healthy or candidates
        if session_id is not None:
            pinned_id = self._session_id_to_backend_id.get(session_id)
            for backend in pool:
                if backend.backend_id == pinned_id:
                    self._session_id_to_backend_id.move_to_end(session_id)
                    self.decision_to_count["session"] += 1
                    return backend
        chosen = self._by_prefix(pool, prefix) if prefix is not None and self.prefix_policy is not None else None
        if chosen is None:
            chosen = min(pool, key=lambda b: b.num_in_flight)
            self.decision_to_count["least_busy"] += 1
        if session_id is not None:
            self.pin(session_id, chosen.backend_id)
        return chosen

    def _by_prefix(self, pool: list[RoutableBackend], prefix: PrefixMatcher) -> RoutableBackend | None:
        policy = self.prefix_policy
        if len(pool) > 1 and policy.is_imbalanced([b.num_in_flight for b in pool]):
            self.decision_to_count["imbalance"] += 1
            return None
        # The most tokens held; among equals the least busy.
        best = max(pool, key=lambda b: (prefix.num_matched_tokens(b.backend_id), -b.num_in_flight))
        num_matched = prefix.num_matched_tokens(best.backend_id)
        if num_matched == 0 or num_matched < policy.cache_threshold * prefix.num_prompt_tokens:
            return None
        self.decision_to_count["prefix"] += 1
        return best

    def pin(self, session_id: str, backend_id: str) -> None:
        """Send `session_id`'s next requests to `backend_id` while it serves their model (LRU-bounded)."""
        self._session_id_to_backend_id[session_id] = backend_id
        self._session_id_to_backend_id.move_to_end(session_id)
        while len(self._session_id_to_backend_id) > self.max_sessions:
            self._session_id_to_backend_id.popitem(last=False)

    def num_candidates(self, model: str) -> int:
        """Connected, non-draining backends serving `model`."""
        return sum(1 for b in self._backend_id_to_backend.values() if model in b.models and not b.is_draining)

    def is_registered(self, backend: RoutableBackend) -> bool:
        return self._backend_id_to_backend.get(backend.backend_id) is backend

    def pinned_backend(self, session_id: str) -> RoutableBackend | None:
        """The connected backend `session_id` is pinned to, if any."""
        backend_id = self._session_id_to_backend_id.get(session_id)
        return self._backend_id_to_backend.get(backend_id) if backend_id is not None else None

    def record_success(self, backend_id: str) -> None:
        self._backend_id_to_num_failures.pop(backend_id, None)
        self._backend_id_to_cool_until.pop(backend_id, None)

    def record_failure(self, backend_id: str) -> None:
        self._backend_id_to_num_failures[backend_id] += 1
        if self._backend_id_to_num_failures[backend_id] >= self.max_consecutive_failures:
            self._backend_id_to_cool_until[backend_id] = self._clock() + self.cool_down_s
            self._backend_id_to_num_failures[backend_id] = 0
