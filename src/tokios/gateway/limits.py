"""Per-key admission limits: requests per minute, tokens per minute, concurrent requests.

Owns the in-memory counters of one gateway process (sliding one-minute windows). The gateway app
calls `admit` before routing and `release` when the response is finished; a refusal raises
OverloadedError (429) carrying the seconds until the key may try again, for `Retry-After`.
Counters are per process: several gateway replicas would each allow the full limit.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Callable

from tokios.errors import OverloadedError
from tokios.gateway.keys import KeyRecord

WINDOW_S = 60.0


class _KeyUsage:
    __slots__ = ("request_times", "token_events", "num_in_flight")

    def __init__(self) -> None:
        self.request_times: collections.deque[float] = collections.deque()
        self.token_events: collections.deque[tuple[float, int]] = collections.deque()
        self.num_in_flight = 0

    def forget_before(self, oldest: float) -> None:
        while self.request_times and self.request_times[0] <= oldest:
            self.request_times.popleft()
        while self.token_events and self.token_events[0][0] <= oldest:
            self.token_events.popleft()


class KeyLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._key_id_to_usage: dict[str, _KeyUsage] = collections.defaultdict(_KeyUsage)

    def admit(self, key: KeyRecord) -> None:
        """Count one request against `key`, or raise OverloadedError without counting it."""
        now = self._clock()
        usage = self._key_id_to_usage[key.key_id]
        usage.forget_before(now - WINDOW_S)
        if key.max_concurrent is not None and usage.num_in_flight >= key.max_concurrent:
            raise OverloadedError(
                f"This key allows at most {key.max_concurrent} concurrent requests.", retry_after_s=1.0
            )
        rpm = key.max_requests_per_minute
        if rpm is not None and len(usage.request_times) >= rpm:
            retry_after_s = usage.request_times[0] + WINDOW_S - now
            raise OverloadedError(
                f"This key allows at most {rpm} requests per minute.", retry_after_s=_whole_seconds(retry_after_s)
            )
        tpm = key.max_tokens_per_minute
        if tpm is not None:
            num_tokens = sum(n for _, n in usage.token_events)
            if num_tokens >= tpm:
                retry_after_s = usage.token_events[0][0] + WINDOW_S - now
                raise OverloadedError(
                    f"This key allows at most {tpm} tokens per minute.", retry_after_s=_whole_seconds(retry_after_s)
                )
        usage.request_times.append(now)
        usage.num_in_flight += 1

    def release(self, key: KeyRecord, num_tokens: int) -> None:
        usage = self._key_id_to_usage[key.key_id]
        usage.num_in_flight = max(0, usage.num_in_flight - 1)
        if num_tokens > 0:
            usage.token_events.append((self._clock(), num_tokens))


def _whole_seconds(seconds: float) -> float:
    # Retry-After is an integer header; round up so a client that obeys it is admitted.
    return float(max(1, math.ceil(seconds)))
