"""Admission control: the bounded waiting queue and the draining state.

A request is admitted while fewer than `max_num_seqs + max_queued_requests` requests are in
flight (the engine runs up to max_num_seqs at once; the rest wait in its queue); beyond that it
gets 429 with Retry-After. Once draining starts (SIGTERM) every new request gets 503 with
Retry-After while admitted ones finish. Tracks the engine request ids in flight so that the
shutdown timeout can abort them. Used by server/serving.py and server/app.py; asyncio only.
"""

from __future__ import annotations

import asyncio

from tokios.errors import OverloadedError


class Admission:
    def __init__(self, max_num_running: int, max_queued_requests: int, retry_after_s: float = 1.0):
        self.max_num_in_flight = max_num_running + max_queued_requests
        self.max_queued_requests = max_queued_requests
        self.retry_after_s = retry_after_s
        self.num_in_flight = 0
        self.is_draining = False
        self.request_ids_in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def check_accepting(self) -> None:
        if self.is_draining:
            raise OverloadedError("The server is shutting down and accepts no new requests.",
                                  status=503, retry_after_s=self.retry_after_s)

    def admit(self) -> Ticket:
        self.check_accepting()
        if self.num_in_flight >= self.max_num_in_flight:
            raise OverloadedError(
                f"The server is overloaded: {self.num_in_flight} requests in flight and the waiting "
                f"queue holds at most {self.max_queued_requests} (--max-queued-requests). Retry later.",
                status=429, retry_after_s=self.retry_after_s)
        self.num_in_flight += 1
        self._idle.clear()
        return Ticket(self)

    def _release(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.is_draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every admitted request finished within timeout_s."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class Ticket:
    """One admitted request; release() is idempotent so every exit path may call it."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._release()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
