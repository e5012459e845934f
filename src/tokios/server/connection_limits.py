"""Ceilings on what one connection may hold: time to send its headers, time to send its body, and
how many connections may be open at once (docs/reliability.md).

uvicorn times out a connection only between requests (keep-alive); a client that connects and
sends nothing, or sends its headers a byte at a time, holds a socket and a file descriptor
forever (slowloris). `HeaderTimeoutProtocol` closes a connection whose next request's headers
have not arrived within the header timeout; `BodyDeadline` (used by server/app.py's middleware)
fails a request whose body has not fully arrived within the body timeout with a 408. The
connection bound is uvicorn's own `limit_concurrency` (a 503 beyond it), and `raise_open_file_limit`
lifts the soft descriptor limit so that the bound, not EMFILE, is what a flood meets.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time

from uvicorn.protocols.http.h11_impl import H11Protocol

from tokios.errors import TokiosError

logger = logging.getLogger("tokios.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 2048


class RequestTimeoutError(TokiosError):
    status = 408
    error_type = "invalid_request_error"


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An H11Protocol class that closes connections whose request headers are late."""

    class HeaderTimeoutProtocol(H11Protocol):
        # Armed when the connection opens and after every response: if no new request cycle has
        # started when it fires (uvicorn starts one when a request's headers are complete), the
        # connection closes. An idle keep-alive connection meets uvicorn's own, shorter timer first.
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._header_timer: asyncio.TimerHandle | None = None
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            cycle_at_arm = self.cycle
            self._header_timer = self.loop.call_later(header_timeout_s, self._on_header_timeout, cycle_at_arm)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _on_header_timeout(self, cycle_at_arm) -> None:
            self._header_timer = None
            # An upgraded connection (a WebSocket) belongs to another protocol object now.
            is_still_http = self.transport.get_protocol() is self
            if is_still_http and self.cycle is cycle_at_arm and not self.transport.is_closing():
                logger.info("closing a connection from %s: no complete request headers within %g s "
                            "(--request-header-timeout)", self.client, header_timeout_s)
                self.transport.close()

    return HeaderTimeoutProtocol


class BodyDeadline:
    """Wraps an ASGI receive: until the body has fully arrived, each receive must complete before
    the request's body deadline, else RequestTimeoutError (408). After that, receive is untouched
    (it then only reports a disconnect, which the server waits for as long as it streams)."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.is_body_complete = False

    async def receive(self, receive):
        if self.is_body_complete:
            return await receive()
        remaining_s = self.deadline - time.monotonic()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, remaining_s))
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"The request body did not arrive within {self.timeout_s:g} s "
                                      "(--request-body-timeout).", code="request_timeout") from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.is_body_complete = True
        return message


def raise_open_file_limit(wanted: int) -> int:
    """Lift the soft RLIMIT_NOFILE towards `wanted` (never above the hard limit); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError):
            return soft
    return soft
