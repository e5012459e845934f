"""The gateway's HTTP front: OpenAI API for clients, a WebSocket endpoint for connectors.

Owns request admission (key, scope, limits, body size), the retry-before-first-byte loop, and
relaying responses as they arrive. Talks to the key store (keys.py), the limiter (limits.py), the
router (router.py) and connector links (link.py). It never parses model output beyond counting
streamed events for the tokens-per-minute limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokios.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    TokiosError,
)
from tokios.gateway import protocol
from tokios.gateway.keys import KIND_CLIENT, KIND_CONNECTOR, KeyRecord, KeyStore
from tokios.gateway.limits import KeyLimiter
from tokios.gateway.link import BackendLink, LinkClosedError, LinkStream
from tokios.gateway.metrics import GatewayMetrics
from tokios.gateway.protocol import Frame, FrameKind
from tokios.gateway.prefix_index import PrefixIndex, PrefixQuery, PromptHasher
from tokios.gateway.router import BackendRouter, PrefixPolicy
from tokios.server.connection_limits import RequestTimeoutError
from tokios.server.dialects import dialect_of_path
from tokios.server.errors import error_payload
from tokios.server.streams import run_watching_disconnect

logger = logging.getLogger("tokios.gateway")

_BACKEND_ID_PATTERN = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_MAX_MODELS_PER_BACKEND = 256
_HELLO_TIMEOUT_S = 10.0


class RequestTooLargeError(InvalidRequestError):
    status = 413


class BackendFailedError(TokiosError):
    status = 502
    error_type = "backend_error"


@dataclass(frozen=True)
class GatewayConfig:
    max_body_bytes: int = 1024 * 1024
    heartbeat_s: float = 10.0
    dead_after_s: float = 25.0
    max_attempts: int = 3
    max_consecutive_failures: int = 3
    cool_down_s: float = 30.0
    no_backend_retry_after_s: float = 5.0
    request_body_timeout_s: float = 30.0
    # Prefix-aware routing (gateway/prefix_index.py): the policy (None: least in-flight only) and
    # the tokenizer file of each model whose prompts the gateway hashes.
    prefix_policy: PrefixPolicy | None = PrefixPolicy()
    model_to_tokenizer_path: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise InvalidRequestError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}", param="max_body_bytes")
        if not 0 < self.heartbeat_s < self.dead_after_s:
            raise InvalidRequestError(
                f"heartbeat_s must be in (0, dead_after_s={self.dead_after_s}), got {self.heartbeat_s}", param="heartbeat_s"
            )
        if self.max_attempts < 1:
            raise InvalidRequestError(f"max_attempts must be >= 1, got {self.max_attempts}", param="max_attempts")


def error_response(exc: TokiosError, path: str = "") -> JSONResponse:
    """The error in the shape of the API the path belongs to (server/dialects/: OpenAI's,
    Anthropic's or Ollama's); the one place gateway errors become HTTP."""
    status, body, headers = error_payload(exc, dialect_of_path(path))
    return JSONResponse(body, status_code=status, headers=headers)


def _stream_error_frames(path: str, message: str, code: str, num_events_sent: int) -> bytes:
    """The frames that end a stream whose backend failed mid-way, in its API's framing (the error
    frame, then the done marker where the API has one), numbered after the events already sent."""
    error = TokiosError(message, code=code)
    error.error_type = "backend_error"
    dialect = dialect_of_path(path)
    return dialect.closing_frames(error, dialect.encoder(first_sequence_number=num_events_sent)).encode()


def _bearer_token(headers: Any) -> str | None:
    """The client key: `Authorization: Bearer`, or `x-api-key` (Anthropic's clients)."""
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key", "").strip() or None


# The POST routes the gateway forwards to a backend serving the body's `model` (the backend's
# connector allows the same list: gateway/connector.py ALLOWED_PATHS).
FORWARDED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                   "/v1/messages/count_tokens", "/v1/embeddings", "/api/chat", "/api/generate", "/api/show",
                   "/api/embed")
_STREAMING_BY_DEFAULT = ("/api/chat", "/api/generate")
RESPONSES_PATH = "/v1/responses"
# An id of OpenAI's Responses API as tokios makes them; the first in a body is the response's own
# (its output items' ids have other prefixes).
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[A-Za-z0-9]{1,64})"')
_RESPONSE_ID_PATH_PART = re.compile(r"resp_[A-Za-z0-9]{1,64}")


def _response_session(response_id: str) -> str:
    """The router's session key of a stored response: its backend holds it."""
    return f"response:{response_id}"


class _Exchange:
    """Book-keeping of one client request from admission to the last byte; `finish` runs once."""

    def __init__(self, gateway: "Gateway", key: KeyRecord):
        self.gateway = gateway
        self.key = key
        self.started_at = time.monotonic()
        self.backend_id = "none"
        self._is_finished = False
        gateway.metrics.in_flight.inc()

    def finish(self, status: str, num_tokens: int = 0) -> None:
        if self._is_finished:
            return
        self._is_finished = True
        metrics = self.gateway.metrics
        metrics.in_flight.dec()
        metrics.requests.labels(self.backend_id, status).inc()
        metrics.request_latency.observe(time.monotonic() - self.started_at)
        self.gateway.limiter.release(self.key, num_tokens)


class _RelayResponse(StreamingResponse):
    """A streaming response whose clean-up runs however it ends: done, client gone, or never started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class Gateway:
    def __init__(self, config: GatewayConfig, key_store: KeyStore):
        self.config = config
        self.key_store = key_store
        self.limiter = KeyLimiter()
        self.router = BackendRouter(
            max_consecutive_failures=config.max_consecutive_failures, cool_down_s=config.cool_down_s,
            prefix_policy=config.prefix_policy,
        )
        self.prefix_index = PrefixIndex()
        # Loaded only where prompts are hashed: prefix routing on, tokenizers given.
        self.prompt_hasher = (PromptHasher(config.model_to_tokenizer_path)
                              if config.prefix_policy is not None and config.model_to_tokenizer_path else None)
        self.metrics = GatewayMetrics()
        self.links: set[BackendLink] = set()

    # ---- clients -------------------------------------------------------------------------

    def authenticate(self, request: Request) -> KeyRecord:
        key = self.key_store.verify(_bearer_token(request.headers), KIND_CLIENT)
        if key is None:
            raise AuthenticationError()
        return key

    async def read_body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLargeError(f"request body must be at most {limit} bytes, got {declared}")
        chunks, size = [], 0

        async def read_all() -> None:
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestTooLargeError(f"request body must be at most {limit} bytes")
                chunks.append(chunk)

        timeout_s = self.config.request_body_timeout_s
        try:
            await asyncio.wait_for(read_all(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestTimeoutError(f"The request body did not arrive within {timeout_s:g} s "
                                      "(--request-body-timeout).", code="request_timeout") from None
        return b"".join(chunks)

    async def forward(self, request: Request, path: str) -> Response:
        key = self.authenticate(request)
        body = await self.read_body(request)
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise InvalidRequestError(f"request body must be JSON: {exc}") from exc
        if not isinstance(payload, dict):
            raise InvalidRequestError("request body must be a JSON object")
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("model must be a non-empty string", param="model")
        # Ollama's chat and generate stream unless told not to; the other APIs only when asked.
        is_stream = (payload.get("stream") is not False) if path in _STREAMING_BY_DEFAULT else payload.get("stream") is True
        if not key.can_use_model(model):
            raise PermissionDeniedError(f"This key may not use model {model!r}.", param="model", code="model_not_allowed")
        session_id = request.headers.get("x-session-id")
        # A Responses follow-up can only be answered by the backend whose store holds its
        # predecessor: that backend wins over the session, the prefix and the load.
        previous_response_id = payload.get("previous_response_id") if path == RESPONSES_PATH else None
        owner = (self.router.pinned_backend(_response_session(previous_response_id))
                 if isinstance(previous_response_id, str) else None)
        self.limiter.admit(key)
        exchange = _Exchange(self, key)
        try:
            prefix = None
            if owner is None and self._routes_by_prefix(model, session_id):
                # In a worker thread: a long prompt takes tens of ms to tokenize.
                token_ids = await asyncio.to_thread(self.prompt_hasher.prompt_token_ids, path, payload)
                if token_ids:
                    prefix = PrefixQuery(self.prefix_index, model, token_ids)
            # Until the first byte goes out, only watching the connection notices a client that
            # left (a whole-body answer is buffered here): cancelling the attempt cancels the
            # backend stream, so the backend aborts its generation instead of finishing it.
            return await run_watching_disconnect(
                request, self._attempt(exchange, request, path, body, model, is_stream, session_id, prefix,
                                       owner.backend_id if owner is not None else None))
        except BaseException as exc:
            status = str(exc.status) if isinstance(exc, TokiosError) else "client_closed"
            exchange.finish(status)
            raise

    def _routes_by_prefix(self, model: str, session_id: str | None) -> bool:
        """Whether the prompt's hashes could change where this request goes."""
        return (self.prompt_hasher is not None and self.prompt_hasher.has_model(model)
                and self.router.num_candidates(model) > 1
                and (session_id is None or self.router.pinned_backend(session_id) is None))

    async def get_stored_response(self, request: Request, response_id: str) -> Response:
        """`GET /v1/responses/{id}`, from the backend that made the response (each backend's store is its own)."""
        key = self.authenticate(request)
        backend = self.router.pinned_backend(_response_session(response_id))
        if not _RESPONSE_ID_PATH_PART.fullmatch(response_id) or backend is None:
            raise NotFoundError(f"No stored response {response_id!r} is reachable through this gateway: it was not "
                                "made through it, was made before it started, or its backend has left.",
                                param="response_id")
        self.limiter.admit(key)
        exchange = _Exchange(self, key)
        exchange.backend_id = backend.backend_id
        path = f"{RESPONSES_PATH}/{response_id}"
        def check_model(content: bytes) -> None:
            try:
                model = json.loads(content).get("model")
            except (ValueError, AttributeError):
                return
            if isinstance(model, str) and not key.can_use_model(model):
                raise NotFoundError(f"No stored response {response_id!r} is reachable with this key.",
                                    param="response_id")
        stream = None
        try:
            stream = backend.open_stream("GET", path, {"accept": "application/json"}, b"")
            # A read charges no tokens to the key: they were counted when the response was made.
            response = await self._first_response(exchange, stream, False, path, check_body=check_model,
                                                   count_usage=False)
            if isinstance(response, str):
                raise BackendFailedError(f"The backend holding response {response_id!r} failed: {response}")
            return response
        except LinkClosedError as exc:
            exchange.finish("502")
            raise BackendFailedError(f"The backend holding response {response_id!r} failed: {exc}") from exc
        except BaseException as exc:
            if stream is not None:
                stream.cancel()
            exchange.finish(str(exc.status) if isinstance(exc, TokiosError) else "client_closed")
            raise

    def _apply_cache_events(self, link: BackendLink, payload: dict[str, Any]) -> None:
        if self.router.is_registered(link):  # a replaced link's late frames are not this backend's
            self.prefix_index.apply(link.backend_id, payload)

    def _remember_response(self, content: bytes, backend_id: str) -> None:
        """Pins the Responses id in `content` (a whole body, or a stream's first events) to its backend."""
        match = _RESPONSE_ID.search(content)
        if match:
            self.router.pin(_response_session(match.group(1).decode()), backend_id)

    async def _attempt(
        self, exchange: _Exchange, request: Request, path: str, body: bytes, model: str, is_stream: bool,
        session_id: str | None, prefix: PrefixQuery | None, owner_backend_id: str | None,
    ) -> Response:
        headers = {"content-type": "application/json", "accept": request.headers.get("accept", "*/*")}
        tried_ids: list[str] = []
        last_failure = ""
        for _ in range(self.config.max_attempts):
            link = self.router.pick(model, session_id, exclude=tried_ids, prefix=prefix,
                                    owner_backend_id=owner_backend_id)
            if link is None:
                break
            if tried_ids:
                self.metrics.retries.inc()
            tried_ids.append(link.backend_id)
            exchange.backend_id = link.backend_id
            try:
                stream = link.open_stream("POST", path, headers, body)
            except LinkClosedError as exc:
                last_failure = str(exc)
                continue
            try:
                response = await self._first_response(exchange, stream, is_stream, path)
            except BaseException:
                stream.cancel()
                raise
            if isinstance(response, Response):
                return response
            last_failure = response
            self.router.record_failure(link.backend_id)
        if not tried_ids:
            raise OverloadedError(
                f"No backend is connected for model {model!r}.",
                status=503,
                retry_after_s=self.config.no_backend_retry_after_s,
            )
        raise BackendFailedError(f"{len(tried_ids)} backend(s) failed for model {model!r}: {last_failure}")

    async def _first_response(self, exchange: _Exchange, stream: LinkStream, is_stream: bool, path: str, *,
                              check_body: Callable[[bytes], None] | None = None,
                              count_usage: bool = True) -> Response | str:
        """The client's response, or a failure message when this backend failed before any byte was
        sent. `check_body` may refuse a whole 2xx body (raising) before it is counted as answered."""
        head = await stream.next_event()
        if head.kind is not FrameKind.RESPONSE_HEAD:
            return _failure_message(head)
        head_fields = head.json()
        status = int(head_fields.get("status", 502))
        content_type = head_fields.get("headers", {}).get("content-type", "application/json")
        backend_id = stream.link.backend_id
        if not (is_stream and status == 200):
            # Whole bodies are small (not streamed), so buffering them keeps retry possible
            # until the very end and lets Content-Length be exact.
            chunks: list[bytes] = []
            while True:
                event = await stream.next_event()
                if event.kind is FrameKind.BODY:
                    chunks.append(event.payload)
                elif event.kind is FrameKind.END:
                    break
                else:
                    return _failure_message(event)
            content = b"".join(chunks)
            if check_body is not None and status < 300:
                check_body(content)
            if status >= 500:
                self.router.record_failure(backend_id)
            else:
                self.router.record_success(backend_id)
            if path == RESPONSES_PATH and status == 200:
                self._remember_response(content, backend_id)
            self.metrics.time_to_first_byte.observe(time.monotonic() - exchange.started_at)
            exchange.finish(str(status), _usage_tokens(content) if count_usage else 0)
            return Response(content, status_code=status, media_type=content_type)
        first = await stream.next_event()
        if first.kind is FrameKind.ERROR:
            return _failure_message(first)
        self.metrics.time_to_first_byte.observe(time.monotonic() - exchange.started_at)
        return self._relay(exchange, stream, first, content_type, path)

    def _relay(self, exchange: _Exchange, stream: LinkStream, first: Frame, content_type: str,
               path: str) -> Response:
        outcome = {"status": "client_closed", "num_events": 0}

        async def relay() -> AsyncIterator[bytes]:
            event = first
            ends_clean = True
            if path == RESPONSES_PATH and first.kind is FrameKind.BODY:
                # response.created, the stream's first event, carries the id.
                self._remember_response(first.payload, stream.link.backend_id)
            # Where a frame ends: a blank line in SSE, a newline in Ollama's NDJSON.
            frame_end = dialect_of_path(path).frame_end.encode()
            # An event is a line that starts with `data:` in SSE (generated text inside the JSON
            # cannot start a line: its newlines are escaped), a line in NDJSON.
            is_at_line_start = True
            while True:
                if event.kind is FrameKind.BODY:
                    # Under load several chunks wait in the queue: one send to the client for
                    # all of them costs one trip through the HTTP stack instead of many.
                    payloads = [event.payload]
                    follower = stream.next_event_nowait()
                    while follower is not None and follower.kind is FrameKind.BODY:
                        payloads.append(follower.payload)
                        follower = stream.next_event_nowait()
                    payload = b"".join(payloads) if len(payloads) > 1 else payloads[0]
                    if frame_end == b"\n":
                        outcome["num_events"] += payload.count(b"\n")
                    else:
                        outcome["num_events"] += payload.count(b"\ndata:") + (
                            is_at_line_start and payload.startswith(b"data:"))
                    is_at_line_start = payload.endswith(b"\n")
                    ends_clean = payload.endswith(frame_end)
                    yield payload
                    if follower is not None:
                        event = follower
                        continue
                elif event.kind is FrameKind.END:
                    outcome["status"] = "200"
                    return
                else:
                    # Bytes already reached the client: no other backend may continue this
                    # text, so the stream ends with its API's error frame (and OpenAI's [DONE]).
                    outcome["status"] = "stream_error"
                    error = event.json()
                    yield (b"" if ends_clean else frame_end) + _stream_error_frames(
                        path, f"The backend failed mid-stream: {error.get('message', 'unknown error')}",
                        str(error.get("code") or "backend_error"), outcome["num_events"],
                    )
                    return
                event = await stream.next_event()

        def on_close() -> None:
            if outcome["status"] != "200":
                stream.cancel()
            if outcome["status"] == "stream_error":
                self.router.record_failure(stream.link.backend_id)
            else:
                self.router.record_success(stream.link.backend_id)
            exchange.finish(outcome["status"], max(0, outcome["num_events"] - 1))

        return _RelayResponse(
            relay(), on_close, media_type=content_type, headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
        )

    def list_models(self, key: KeyRecord) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {"id": model, "object": "model", "created": 0, "owned_by": "tokios-gateway"}
                for model in self.router.models()
                if key.can_use_model(model)
            ],
        }

    def model_card(self, key: KeyRecord, model: str) -> dict[str, Any]:
        """`GET /v1/models/{id}` (`client.models.retrieve`): one of list_models' cards."""
        for card in self.list_models(key)["data"]:
            if card["id"] == model:
                return card
        raise NotFoundError(f"The model {model!r} does not exist or is not reachable with this key; this gateway "
                            f"serves {[card['id'] for card in self.list_models(key)['data']]}.",
                            param="model", code="model_not_found")

    def status(self) -> dict[str, Any]:
        return {
            "num_backends": len(self.router.backends),
            "models": self.router.models(),
            "backends": [
                {**link.describe(), "is_cooling": self.router.is_cooling(link.backend_id),
                 "num_cached_blocks_reported": self.prefix_index.num_blocks(link.backend_id)}
                for link in self.router.backends
            ],
            "routing_decisions": dict(self.router.decision_to_count),
            "indexed_backends": self.prefix_index.backend_ids(),
        }

    # ---- connectors ----------------------------------------------------------------------

    async def serve_connector(self, websocket: WebSocket) -> None:
        if self.key_store.verify(_bearer_token(websocket.headers), KIND_CONNECTOR) is None:
            await websocket.close(code=1008)  # before accept: the handshake is answered 403
            return
        await websocket.accept()
        try:
            hello = await asyncio.wait_for(websocket.receive_bytes(), _HELLO_TIMEOUT_S)
            backend_id, models = _parse_hello(protocol.decode(hello)[0])
        except Exception as exc:
            logger.warning("connector hello refused: %s", exc)
            await websocket.close(code=1002, reason=str(exc)[:100])
            return
        link = BackendLink(
            websocket, backend_id, models, heartbeat_s=self.config.heartbeat_s, dead_after_s=self.config.dead_after_s,
            on_cache_events=self._apply_cache_events,
        )
        await websocket.send_bytes(
            protocol.encode_json(
                FrameKind.WELCOME,
                protocol.CONTROL_STREAM_ID,
                {"heartbeat_s": self.config.heartbeat_s, "dead_after_s": self.config.dead_after_s},
            )
        )
        replaced = self.router.add(link)
        if replaced is not None:
            replaced.close()
        self.prefix_index.drop(backend_id)  # what an earlier link reported; this one sends its own
        self.links.add(link)
        self.metrics.connected_backends.set(len(self.router.backends))
        logger.info("backend %s registered with models %s", backend_id, list(models))
        try:
            await link.run()
        finally:
            self.router.remove(link)
            self.links.discard(link)
            if all(backend.backend_id != backend_id for backend in self.router.backends):
                self.prefix_index.drop(backend_id)  # unless a new link re-registered the same id
            self.metrics.connected_backends.set(len(self.router.backends))
            logger.info("backend %s disconnected", backend_id)


def _failure_message(frame: Frame) -> str:
    try:
        return str(frame.json().get("message", "backend error"))
    except InvalidRequestError:
        return "backend error"


def _usage_tokens(content: bytes) -> int:
    try:
        usage = json.loads(content).get("usage") or {}
        return int(usage.get("total_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def _parse_hello(frame: Frame) -> tuple[str, tuple[str, ...]]:
    if frame.kind is not FrameKind.HELLO:
        raise InvalidRequestError(f"first frame must be HELLO, got {frame.kind.name}")
    fields = frame.json()
    if fields.get("protocol_version") != protocol.PROTOCOL_VERSION:
        raise InvalidRequestError(
            f"protocol_version must be {protocol.PROTOCOL_VERSION}, got {fields.get('protocol_version')!r}"
        )
    backend_id = fields.get("backend_id")
    if not isinstance(backend_id, str) or not _BACKEND_ID_PATTERN.match(backend_id):
        raise InvalidRequestError("backend_id must be 1-128 characters of letters, digits, '.', '_', ':', '-'")
    models = fields.get("models")
    if (
        not isinstance(models, list)
        or not 1 <= len(models) <= _MAX_MODELS_PER_BACKEND
        or not all(isinstance(m, str) and 0 < len(m) <= 256 for m in models)
    ):
        raise InvalidRequestError(f"models must be a list of 1-{_MAX_MODELS_PER_BACKEND} model names")
    return backend_id, tuple(models)


def create_app(config: GatewayConfig, key_store: KeyStore) -> FastAPI:
    gateway = Gateway(config, key_store)
    app = FastAPI(title="tokios gateway", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway

    @app.exception_handler(TokiosError)
    async def _on_tokios_error(request: Request, exc: TokiosError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "num_backends": len(gateway.router.backends)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type=gateway.metrics.content_type)

    @app.get("/status")
    async def status(request: Request) -> dict[str, Any]:
        gateway.authenticate(request)
        return gateway.status()

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return gateway.list_models(gateway.authenticate(request))

    @app.get("/v1/models/{model:path}")
    async def model_card(request: Request, model: str) -> dict[str, Any]:
        return gateway.model_card(gateway.authenticate(request), model)

    def add_forwarded_route(path: str) -> None:
        async def forwarded(request: Request) -> Response:
            return await gateway.forward(request, path)
        app.add_api_route(path, forwarded, methods=["POST"], name=path)

    for path in FORWARDED_PATHS:
        add_forwarded_route(path)

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await gateway.get_stored_response(request, response_id)

    @app.get("/api/tags")
    async def ollama_tags(request: Request) -> dict[str, Any]:
        listed = gateway.list_models(gateway.authenticate(request))["data"]
        return {"models": [{"name": card["id"], "model": card["id"]} for card in listed]}

    @app.get("/api/version")
    async def ollama_version() -> dict[str, Any]:
        from tokios import __version__

        return {"version": __version__}

    @app.websocket("/v1/connect")
    async def connect(websocket: WebSocket) -> None:
        await gateway.serve_connector(websocket)

    return app
