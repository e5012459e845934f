"""The prefix cache's events for a router outside the process: which blocks are stored, which dropped.

The block pool writes here (in the engine thread) each time a chained block hash enters or leaves
its hash map; the server reads (in its event loop) what came after a sequence number it was given,
for `GET /v1/engine/cache_events`, which the gateway connector polls with `--report-cache-events`
so that the gateway can route a request to the backend holding the longest part of its prompt
(gateway/prefix_index.py). The log is bounded: a reader that fell further behind than the log
holds, or a new reader, gets a snapshot of every hash stored now instead (`is_reset`).

Only group 0's keys (plain int hashes, kv_cache/manager.py cache_key) are logged: other groups
hold the same tokens' blocks for their own layers, so group 0 says where a prefix is.
"""

from __future__ import annotations

import collections
import itertools
import threading
import uuid
from dataclasses import dataclass

DEFAULT_MAX_EVENTS = 65_536


@dataclass(frozen=True)
class CacheEvents:
    next_seq: int  # ask with this next time
    is_reset: bool  # stored_hashes is the whole set; forget what you had
    stored_hashes: list[int]
    removed_hashes: list[int]


class CacheEventLog:
    """Thread-safe: one writer (the engine thread), any readers."""

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS):
        # Names this log among every log a server has had (a model unloaded and loaded again
        # starts a new one): a reader's sequence number means nothing in another log.
        self.log_id = uuid.uuid4().hex
        self._lock = threading.Lock()
        self._events: collections.deque[tuple[bool, int]] = collections.deque(maxlen=max_events)
        self._next_seq = 0  # the sequence number of the next event
        self._stored: set[int] = set()

    def record_stored(self, key: object) -> None:
        self._record(True, key)

    def record_removed(self, key: object) -> None:
        self._record(False, key)

    def _record(self, is_stored: bool, key: object) -> None:
        if type(key) is int:
            with self._lock:
                self._events.append((is_stored, key))
                self._next_seq += 1
                if is_stored:
                    self._stored.add(key)
                else:
                    self._stored.discard(key)

    def read(self, since_seq: int, log_id: str = "") -> CacheEvents:
        """Events from `since_seq` of this log on; a snapshot when those are no longer held, or
        the reader's sequence number belongs to another log."""
        with self._lock:
            first_held = self._next_seq - len(self._events)
            if log_id != self.log_id or not first_held <= since_seq <= self._next_seq:
                return CacheEvents(self._next_seq, True, list(self._stored), [])
            # The net change, in order: a hash stored and then dropped (or the reverse) in one
            # read counts as its last event only.
            key_to_is_stored = {}
            for is_stored, key in itertools.islice(self._events, since_seq - first_held, None):
                key_to_is_stored[key] = is_stored
            stored = [key for key, is_stored in key_to_is_stored.items() if is_stored]
            removed = [key for key, is_stored in key_to_is_stored.items() if not is_stored]
            return CacheEvents(self._next_seq, False, stored, removed)
