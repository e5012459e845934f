"""The connector: dials out to a gateway and carries its requests to a local OpenAI-compatible URL.

Owns the outbound WebSocket (websockets library), registration (HELLO with a stable backend id
and models), one task per request stream that calls the local backend with httpx and streams the
answer back in small frames, heartbeats, reconnect with exponential backoff and jitter, and drain.
It talks to the gateway only through gateway/protocol.py frames; `tokios connect` and
`tokios serve --connect` start it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import InvalidStatus

from tokios.errors import AuthenticationError, InvalidRequestError
from tokios.gateway import protocol
from tokios.gateway.protocol import FrameKind

logger = logging.getLogger("tokios.connector")

# The connector is not an open proxy into the local network: only the generation endpoints the
# gateway forwards (gateway/app.py FORWARDED_PATHS) and the model list pass.
ALLOWED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/responses", "/v1/messages",
                           "/v1/messages/count_tokens", "/v1/embeddings", "/api/chat", "/api/generate", "/api/show",
                           "/api/embed"})
# A stored OpenAI response, read back by id (GET only).
STORED_RESPONSE_PATH = re.compile(r"/v1/responses/resp_[A-Za-z0-9]{1,64}")
MAX_REQUEST_BYTES = 8 * 1024 * 1024


def gateway_connect_url(url: str) -> str:
    """ws(s)://host:port/v1/connect from any of http(s)/ws(s) URLs, with or without the path."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise InvalidRequestError(f"gateway URL must be http(s):// or ws(s)://host[:port], got {url!r}", param="gateway_url")
    path = parts.path.rstrip("/")
    if not path.endswith("/v1/connect"):
        path += "/v1/connect"
    return urlunsplit((scheme, parts.netloc, path, "", ""))


def default_backend_id(backend_url: str) -> str:
    port = urlsplit(backend_url).port or 80
    return f"{socket.gethostname()}-{port}"[:128]


@dataclass
class ConnectorConfig:
    gateway_url: str
    token: str
    backend_url: str = "http://127.0.0.1:8000"
    backend_id: str = ""
    models: tuple[str, ...] = ()  # empty: ask the backend's /v1/models
    backend_api_key: str | None = None
    heartbeat_s: float = 10.0
    dead_after_s: float = 25.0
    min_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    drain_grace_s: float = 30.0
    backend_timeout_s: float = 600.0
    ca_file: str | None = None  # trust this CA for a wss:// gateway (e.g. a self-signed certificate)
    # Poll the backend's /v1/engine/cache_events this often and pass what changed to the gateway,
    # for prefix-aware routing (gateway/prefix_index.py); 0: do not report.
    cache_events_interval_s: float = 0.0
    extra_headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.backend_url = self.backend_url.rstrip("/")
        if not self.backend_id:
            self.backend_id = default_backend_id(self.backend_url)
        if not self.token:
            raise InvalidRequestError("token must be a connector token (tc-...)", param="token")
        if not 0 < self.min_backoff_s <= self.max_backoff_s:
            raise InvalidRequestError(
                f"min_backoff_s must be in (0, max_backoff_s={self.max_backoff_s}], got {self.min_backoff_s}",
                param="min_backoff_s",
            )
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise InvalidRequestError(
                f"heartbeat_s must be in (0, dead_after_s={self.dead_after_s}), got {self.heartbeat_s}", param="heartbeat_s"
            )


REPORT_CACHE_EVENTS_INTERVAL_S = 0.25  # what --report-cache-events polls at

# A hash in a CACHE_EVENTS frame: 32 hex digits and JSON punctuation; the rest of a frame's payload
# is the model's name and a few small fields.
_HASH_BYTES = 36
_FRAME_FIELDS_BYTES = 256


def cache_event_frames(model: str, events: dict[str, Any]) -> list[bytes]:
    """A backend's cache events as CACHE_EVENTS frames; a snapshot too large for one frame is cut,
    only the first of its frames saying `reset`."""
    changes = [(True, key) for key in events["stored"]] + [(False, key) for key in events["removed"]]
    max_hashes_per_frame = (protocol.MAX_PAYLOAD_BYTES - _FRAME_FIELDS_BYTES
                            - len(json.dumps(model).encode())) // _HASH_BYTES
    if max_hashes_per_frame < 1:
        raise InvalidRequestError(f"model name too long to report cache events: {model[:40]!r}...", param="model")
    frames = []
    for start in range(0, max(len(changes), 1), max_hashes_per_frame):
        part = changes[start:start + max_hashes_per_frame]
        frames.append(protocol.encode_json(FrameKind.CACHE_EVENTS, protocol.CONTROL_STREAM_ID, {
            "model": model, "reset": bool(events["reset"]) and start == 0, "block_size": events["block_size"],
            "root_hash": events["root_hash"], "stored": [key for is_stored, key in part if is_stored],
            "removed": [key for is_stored, key in part if not is_stored]}))
    return frames


def backoff_delay_s(num_failures: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: a random point in the upper half of the current step,
    so a fleet of connectors cut off together does not reconnect in lockstep."""
    step_s = min(max_s, min_s * 2 ** min(num_failures, 30))
    return step_s * rng.uniform(0.5, 1.0)


class Connector:
    def __init__(self, config: ConnectorConfig):
        self.config = config
        self.models: tuple[str, ...] = tuple(config.models)
        self.num_registrations = 0
        self._stop = asyncio.Event()
        self._is_draining = False
        self._rng = random.Random()
        self._http: httpx.AsyncClient | None = None

    # ---- public life cycle ---------------------------------------------------------------

    def request_drain(self) -> None:
        """Stop taking work: tell the gateway, let in-flight streams finish (up to the grace), exit."""
        self._is_draining = True
        self._stop.set()

    async def run(self) -> None:
        """Connect, serve, reconnect until drained. Raises AuthenticationError if the token is refused."""
        headers = {"Authorization": f"Bearer {self.config.backend_api_key}"} if self.config.backend_api_key else {}
        self._http = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(self.config.backend_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )
        try:
            if not self.models:
                self.models = await self._discover_models()
            num_failures = 0
            while not self._stop.is_set():
                try:
                    await self._serve_one_connection()
                    num_failures = 0
                except InvalidStatus as exc:
                    if exc.response.status_code in (401, 403):
                        raise AuthenticationError(
                            f"the gateway refused the connector token (HTTP {exc.response.status_code})"
                        ) from exc
                    logger.warning("gateway answered HTTP %s; retrying", exc.response.status_code)
                except (OSError, asyncio.TimeoutError, websockets.WebSocketException, InvalidRequestError) as exc:
                    logger.warning("gateway connection failed: %s", exc.__class__.__name__)
                if self._stop.is_set():
                    break
                num_failures += 1
                delay_s = backoff_delay_s(num_failures, self.config.min_backoff_s, self.config.max_backoff_s, self._rng)
                try:
                    await asyncio.wait_for(self._stop.wait(), delay_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self._http.aclose()

    # ---- one connection ------------------------------------------------------------------

    async def _discover_models(self) -> tuple[str, ...]:
        num_failures = 0
        while True:
            try:
                response = await self._http.get(self.config.backend_url + "/v1/models", timeout=10.0)
                response.raise_for_status()
                models = tuple(m["id"] for m in response.json()["data"])
                if models:
                    return models
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                logger.warning("backend %s not ready for /v1/models: %s", self.config.backend_url, exc)
            num_failures += 1
            await asyncio.sleep(backoff_delay_s(num_failures, self.config.min_backoff_s, self.config.max_backoff_s, self._rng))

    def _tls_options(self) -> dict[str, Any]:
        if self.config.ca_file and gateway_connect_url(self.config.gateway_url).startswith("wss://"):
            return {"ssl": ssl.create_default_context(cafile=self.config.ca_file)}
        return {}

    async def _serve_one_connection(self) -> None:
        async with websockets.connect(
            gateway_connect_url(self.config.gateway_url),
            additional_headers={"Authorization": f"Bearer {self.config.token}", **self.config.extra_headers},
            compression=None,  # token deltas are tiny; deflate costs CPU and latency for nothing
            ping_interval=None,  # liveness is the protocol's own PING frames, both ways
            max_size=protocol.MAX_MESSAGE_BYTES,
            proxy=None,
            open_timeout=10.0,
            **self._tls_options(),
        ) as websocket:
            await websocket.send(
                protocol.encode_json(
                    FrameKind.HELLO,
                    protocol.CONTROL_STREAM_ID,
                    {
                        "protocol_version": protocol.PROTOCOL_VERSION,
                        "backend_id": self.config.backend_id,
                        "models": list(self.models),
                    },
                )
            )
            welcome = protocol.decode(await asyncio.wait_for(websocket.recv(), 10.0))[0]
            if welcome.kind is not FrameKind.WELCOME:
                raise websockets.WebSocketException(f"expected WELCOME, got {welcome.kind.name}")
            self.num_registrations += 1
            logger.info("registered as %s with models %s", self.config.backend_id, list(self.models))
            await _ConnectionSession(self, websocket).serve()


class _ConnectionSession:
    """The streams of one WebSocket connection; gone when the connection is."""

    def __init__(self, connector: Connector, websocket: ClientConnection):
        self.connector = connector
        self.config = connector.config
        self.websocket = websocket
        self._outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._stream_id_to_task: dict[int, asyncio.Task] = {}
        self._stream_id_to_request: dict[int, tuple[dict[str, Any], list[bytes]]] = {}
        self._last_heard = time.monotonic()
        self._writer_finished = asyncio.Event()

    async def serve(self) -> None:
        tasks = [
            asyncio.create_task(self._read_loop()),
            asyncio.create_task(self._write_loop()),
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._drain_when_asked()),
        ]
        if self.config.cache_events_interval_s > 0:
            tasks.append(asyncio.create_task(self._report_cache_events()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in [*tasks, *self._stream_id_to_task.values()]:
                task.cancel()
            await asyncio.gather(*tasks, *self._stream_id_to_task.values(), return_exceptions=True)

    async def _drain_when_asked(self) -> None:
        await self.connector._stop.wait()
        self._outbox.put_nowait(protocol.encode(FrameKind.DRAIN, protocol.CONTROL_STREAM_ID))
        deadline = time.monotonic() + self.config.drain_grace_s
        while self._stream_id_to_task and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        logger.info("drained with %d stream(s) still open", len(self._stream_id_to_task))
        # The writer flushes every frame queued before this marker, then ends the session.
        self._outbox.put_nowait(None)
        await self._writer_finished.wait()

    async def _read_loop(self) -> None:
        async for message in self.websocket:
            self._last_heard = time.monotonic()
            for frame in protocol.decode(message):
                self._dispatch(frame)

    def _dispatch(self, frame: protocol.Frame) -> None:
        if frame.stream_id == protocol.CONTROL_STREAM_ID:
            return  # PING: hearing it is the point
        if frame.kind is FrameKind.REQUEST_HEAD:
            self._stream_id_to_request[frame.stream_id] = (frame.json(), [])
        elif frame.kind is FrameKind.BODY:
            pending = self._stream_id_to_request.get(frame.stream_id)
            if pending is not None:
                pending[1].append(frame.payload)
        elif frame.kind is FrameKind.END:
            pending = self._stream_id_to_request.pop(frame.stream_id, None)
            if pending is not None:
                head, chunks = pending
                self._stream_id_to_task[frame.stream_id] = asyncio.create_task(
                    self._forward(frame.stream_id, head, b"".join(chunks))
                )
        elif frame.kind is FrameKind.CANCEL:
            self._stream_id_to_request.pop(frame.stream_id, None)
            task = self._stream_id_to_task.get(frame.stream_id)
            if task is not None:
                task.cancel()

    async def _write_loop(self) -> None:
        try:
            await protocol.write_batches(self._outbox, self.websocket.send)
        finally:
            self._writer_finished.set()

    async def _heartbeat_loop(self) -> None:
        ping = protocol.encode(FrameKind.PING, protocol.CONTROL_STREAM_ID)
        while True:
            await asyncio.sleep(min(self.config.heartbeat_s, self.config.dead_after_s / 2))
            if time.monotonic() - self._last_heard > self.config.dead_after_s:
                logger.warning("gateway silent for over %.0f s; reconnecting", self.config.dead_after_s)
                return
            self._outbox.put_nowait(ping)

    async def _report_cache_events(self) -> None:
        """Each model's prefix-cache changes, polled from the backend; a new connection starts
        with a snapshot (the gateway forgets a backend's blocks when its link ends). A failed
        poll loses a hint, never the connection."""
        model_to_cursor = {model: (-1, None) for model in self.connector.models}
        is_failure_logged = False
        while True:
            for model, (since, log_id) in model_to_cursor.items():
                try:
                    response = await self.connector._http.get(
                        self.config.backend_url + "/v1/engine/cache_events",
                        params={"model": model, "since": since, "log_id": log_id or ""}, timeout=10.0)
                    response.raise_for_status()
                    events = response.json()
                    cursor = (int(events["next"]), str(events["log_id"]))
                    # A reset is news only from a log this side has not read (an unloaded model
                    # answers a reset of nothing each time).
                    if (events["reset"] and cursor[1] != log_id) or events["stored"] or events["removed"]:
                        for frame in cache_event_frames(model, events):
                            self._outbox.put_nowait(frame)
                    model_to_cursor[model] = cursor
                except (httpx.HTTPError, ValueError, KeyError, TypeError, InvalidRequestError) as exc:
                    if not is_failure_logged:
                        logger.warning("cannot report the prefix cache of %s to the gateway (%s); routing there "
                                       "goes by load", model, getattr(exc, "message", exc))
                        is_failure_logged = True
            await asyncio.sleep(self.config.cache_events_interval_s)

    def _send_error(self, stream_id: int, message: str, code: str) -> None:
        self._outbox.put_nowait(protocol.encode_json(FrameKind.ERROR, stream_id, {"message": message, "code": code}))

    async def _forward(self, stream_id: int, head: dict[str, Any], body: bytes) -> None:
        """Call the local backend and stream its answer back; cancelled when the client leaves,
        which closes the backend connection so the backend aborts the generation."""
        try:
            method, path = str(head.get("method", "POST")), str(head.get("path", ""))
            if path not in ALLOWED_PATHS and not (method == "GET" and STORED_RESPONSE_PATH.fullmatch(path)):
                self._send_error(stream_id, f"path must be one of {sorted(ALLOWED_PATHS)}, got {path!r}", "bad_path")
                return
            if len(body) > MAX_REQUEST_BYTES:
                self._send_error(stream_id, f"request body must be at most {MAX_REQUEST_BYTES} bytes", "too_large")
                return
            headers = {k: v for k, v in dict(head.get("headers") or {}).items() if k in ("content-type", "accept")}
            http = self.connector._http
            async with http.stream(method, self.config.backend_url + path, content=body, headers=headers) as response:
                self._outbox.put_nowait(
                    protocol.encode_json(
                        FrameKind.RESPONSE_HEAD,
                        stream_id,
                        {"status": response.status_code,
                         "headers": {"content-type": response.headers.get("content-type", "application/json")}},
                    )
                )
                async for chunk in response.aiter_raw():
                    for frame in protocol.encode_body(stream_id, chunk):
                        self._outbox.put_nowait(frame)
            self._outbox.put_nowait(protocol.encode(FrameKind.END, stream_id))
        except httpx.HTTPError as exc:
            self._send_error(stream_id, f"local backend failed: {exc.__class__.__name__}: {exc}", "backend_unreachable")
        finally:
            self._stream_id_to_task.pop(stream_id, None)

