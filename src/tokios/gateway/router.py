"""Choosing a backend for a request: least in-flight, session affinity, failure cool-down.

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
from typing import Callable, Iterable, Protocol


class RoutableBackend(Protocol):
    backend_id: str
    models: tuple[str, ...]
    num_in_flight: int
    is_draining: bool


class BackendRouter:
    def __init__(
        self,
        *,
        max_consecutive_failures: int = 3,
        cool_down_s: float = 30.0,
        max_sessions: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_consecutive_failures = max_consecutive_failures
        self.cool_down_s = cool_down_s
        self.max_sessions = max_sessions
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

    def pick(self, model: str, session_id: str | None = None, exclude: Iterable[str] = ()) -> RoutableBackend | None:
        """The backend for one attempt, or None when no backend serves `model`.

        Healthy backends come first; cooling ones are used only when nothing else serves
        the model, since a backend that may work beats a certain 503.
        """
        excluded_ids = set(exclude)
        candidates = [
            b for b in self._backend_id_to_backend.values()
            if model in b.models and not b.is_draining and b.backend_id not in excluded_ids
        ]
        if not candidates:
            return None
        healthy = [b for b in candidates if not self.is_cooling(b.backend_id)]
        pool = healthy or candidates
        if session_id is not None:
            pinned_id = self._session_id_to_backend_id.get(session_id)
            for backend in pool:
                if backend.backend_id == pinned_id:
                    self._session_id_to_backend_id.move_to_end(session_id)
                    return backend
        chosen = min(pool, key=lambda b: b.num_in_flight)
        if session_id is not None:
            self.pin(session_id, chosen.backend_id)
        return chosen

    def pin(self, session_id: str, backend_id: str) -> None:
        """Send `session_id`'s next requests to `backend_id` while it serves their model (LRU-bounded)."""
        self._session_id_to_backend_id[session_id] = backend_id
        self._session_id_to_backend_id.move_to_end(session_id)
        while len(self._session_id_to_backend_id) > self.max_sessions:
            self._session_id_to_backend_id.popitem(last=False)

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
