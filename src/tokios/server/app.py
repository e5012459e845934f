"""The FastAPI application: routes, the guard middleware, lifespan (engine loading) and draining.

`create_app(settings, engine=..., engine_loader=...)` builds the app around a ready AsyncEngine
or loads one in a worker thread after the server is listening (so `/health` answers 503 while
loading). The API routes are the dialects' (server/dialects/: each record lists its routes, which
parse their bodies themselves so that every malformed body becomes a 400 in the dialect's error
shape via server/errors.py); this module adds the server's own routes (health, metrics, engine
stats, the web page).
GuardMiddleware (pure ASGI, so streaming and disconnects pass through untouched) checks API keys,
enforces --max-body-size and counts responses by status. `ServerState.drain()` is the SIGTERM path
used by server/cli.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokios.errors import OverloadedError, TokiosError
from tokios.server.admission import Admission
from tokios.server.auth import ApiKeyChecker
from tokios.server.connection_limits import BodyDeadline
from tokios.server.dialects import DIALECTS, dialect_of_path
from tokios.server.dialects.openai_responses import ResponseStore
from tokios.server.embeddings import require_kind
from tokios.server.errors import RequestTooLargeError, error_response, retry_after_header
from tokios.server.metrics import CONTENT_TYPE, ServerMetrics
from tokios.server.registry import UNLOADED, ModelEntry, ModelLease, ModelRegistry, ModelSpec
from tokios.server.serving import Serving, ServerSettings
from tokios.server.streams import StreamedResponse
from tokios.server.web_assets import (CONTENT_SECURITY_POLICY, FAVICON_FILE, STATIC_DIR, PageFiles, vendor_file,
                                     warn_if_vendor_files_missing)
from tokios.tokenizer.tokenizer import no_chat_template_error

logger = logging.getLogger("tokios.server")


class ServerState:
    """What the routes share: settings, metrics, admission, and the model registry."""

    def __init__(self, settings: ServerSettings, registry: ModelRegistry):
        self.settings = settings
        self.registry = registry
        self.is_ready = False  # the default model loaded once (the server answers from then on)
        self.load_error: BaseException | None = None
        self.on_load_failure: Callable[[], None] = lambda: None
        self.metrics = ServerMetrics(self.engine_stats)
        self.admission = Admission(settings.max_num_seqs, settings.max_queued_requests, settings.retry_after_s)
        self.created = int(time.time())
        # The OpenAI Responses API's stored responses (previous_response_id, GET /v1/responses/{id}).
        self.responses_store = ResponseStore(settings.responses_store_size, settings.responses_store_ttl_s)
        registry.make_serving = lambda engine, spec: Serving(engine, self.settings, self.metrics, self.admission,
                                                             spec.names, spec.sampling_defaults)
        registry.describe_serving = lambda serving: serving.embedding.card()
        registry.on_loaded = self._watch_engine
        # Tasks that run beside the server once the model is ready (e.g. the gateway connector of
        # `tokios serve --connect`), and what each wants done when draining starts.
        self.companions: list[Callable[["ServerState"], Any]] = []
        self.companion_tasks: list[asyncio.Task] = []
        self.on_drain: list[Callable[[], None]] = []
        # Set when the engine failed for good (a step raised); the CLI exits non-zero.
        self.engine_failure: BaseException | None = None
        self.on_engine_failure: Callable[[], None] = lambda: None
        self._is_stall_logged = False

    def engine_stats(self) -> list[tuple[str, Any]]:
        return [(entry.name, entry.engine.stats()) for entry in self.registry.loaded_entries()]

    def check_ready(self) -> None:
        if not self.is_ready:
            raise OverloadedError("The model is still loading.", status=503, retry_after_s=self.settings.retry_after_s)

    async def acquire(self, model: str | None, keep_alive_s: float | None = None) -> ModelLease:
        """The named (or default) model, loaded and pinned for one request."""
        self.check_ready()
        self.admission.check_accepting()
        return await self.registry.acquire(model, keep_alive_s)

    async def respond(self, model: str | None, run: Callable[[ModelLease], Any],
                      keep_alive_s: float | None = None, needs: str | None = None,
                      uses_chat_template: bool = False) -> Response:
        """Runs one request against its model. A streamed answer's job releases the lease when the
        stream ends; anything else releases it here. `needs`: the kind of model the route serves
        (encoder/loader.py); `uses_chat_template`: the route renders chat messages. Both are
        checked before the model loads (a lazily loaded model stays unloaded)."""
        if needs is not None:
            entry = self.registry.entry(model)
            require_kind(entry.spec.kind, needs, entry.name)
        if uses_chat_template and not self.registry.entry(model).spec.has_chat_template:
            raise no_chat_template_error()
        lease = await self.acquire(model, keep_alive_s)
        try:
            response = await run(lease)
        except BaseException:
            lease.release()
            raise
        if not isinstance(response, StreamedResponse):
            lease.release()
        return response

    async def start(self) -> None:
        try:
            lease = await self.registry.acquire(None)
            lease.release()
        except BaseException as exc:  # the CLI reports it and exits non-zero
            self.load_error = exc
            logger.error("loading the model failed: %s", getattr(exc, "message", exc))
            self.on_load_failure()
            return
        self.is_ready = True
        self.registry.start_sweeper()
        self.companion_tasks = [asyncio.create_task(companion(self)) for companion in self.companions]

    def _watch_engine(self, entry: ModelEntry) -> None:
        loop = asyncio.get_running_loop()
        engine = entry.engine
        logger.info("model %s ready (max_model_len %d)", entry.name, engine.max_model_len)
        engine.on_failure = lambda error: loop.call_soon_threadsafe(self._engine_failed, entry, engine, error)

    def _engine_failed(self, entry: ModelEntry, engine: Any, error: BaseException) -> None:
        message = getattr(error, "message", error)
        if len(self.registry.entries) > 1:
            # Several models: the others keep serving; this one is dropped and loads afresh on its
            # next request (its in-flight requests already got the error).
            logger.error("model %s failed (%s); every request in flight on it got the error; it is unloaded "
                         "and loads again on its next request", entry.name, message)
            if entry.engine is engine:
                entry.state, entry.engine, entry.serving = UNLOADED, None, None
            return
        self.engine_failure = error
        logger.error("the engine failed (%s); every request in flight got the error; the server exits", message)
        self.on_engine_failure()

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status code, body) of GET /health: cheap, but 503 unless the engines make progress."""
        if self.admission.is_draining:
            return 503, {"status": "draining"}
        if not self.is_ready:
            return 503, {"status": "loading" if self.load_error is None else "failed"}
        if self.engine_failure is not None:
            return 503, {"status": "failed", "error": str(getattr(self.engine_failure, "message", self.engine_failure))}
        for entry in self.registry.loaded_entries():
            engine = entry.engine
            if not engine.is_alive:
                error = engine.failure
                return 503, {"status": "failed", "error": str(getattr(error, "message", error) or "engine thread gone")}
            stall = engine.stall_report(self.settings.stall_timeout_s)
            if stall is not None:
                summary, stack = stall
                if not self._is_stall_logged:  # once per stall, with the stack; the next ok resets it
                    logger.error("health: model %s: %s. Engine thread stack:\n%s", entry.name, summary, stack)
                    self._is_stall_logged = True
                return 503, {"status": "stalled", "error": summary}
        self._is_stall_logged = False
        return 200, {"status": "ok"}

    async def generation_probe(self) -> tuple[int, dict[str, Any]]:
        """GET /health?generate=1: one greedy token through the default model, within a deadline."""
        status, body = self.health()
        if status != 200:
            return status, body
        from tokios.sampling_params import SamplingParams

        timeout_s = self.settings.health_generate_timeout_s
        started = time.monotonic()

        async def one_token() -> int:
            lease = await self.registry.acquire(None)
            try:
                engine = lease.serving.engine
                if getattr(engine, "is_encoder", False):  # an embedding model or cross-encoder: one forward
                    await engine.encode([engine.tokenizer.encode("Hello")])
                    return 0
                num_tokens = 0
                async for output in engine.generate(None, SamplingParams(max_tokens=1, temperature=0.0,
                                                                         ignore_eos=True),
                                                    prompt_token_ids=engine.tokenizer.encode("Hello")):
                    num_tokens = len(output.outputs[0].token_ids)
                return num_tokens
            finally:
                lease.release()

        try:
            num_tokens = await asyncio.wait_for(one_token(), timeout_s)
        except asyncio.TimeoutError:
            return 503, {"status": "stalled", "error": f"a one-token generation did not finish within {timeout_s:g} s "
                                                       "(--health-generate-timeout)"}
        except Exception as exc:
            return 503, {"status": "failed", "error": str(getattr(exc, "message", exc))}
        return 200, {"status": "ok", "generated_tokens": num_tokens,
                     "latency_ms": round(1000 * (time.monotonic() - started), 1)}

    async def drain(self) -> None:
        """Stops admitting work, waits for in-flight requests (up to the timeout), aborts the rest."""
        self.admission.start_draining()
        for hook in self.on_drain:
            hook()
        timeout_s = self.settings.shutdown_timeout_s
        logger.info("draining: %d requests in flight, waiting up to %.1f s", self.admission.num_in_flight, timeout_s)
        if await self.admission.wait_idle(timeout_s):
            return
        request_ids = sorted(self.admission.request_ids_in_flight)
        logger.warning("shutdown timeout reached: aborting %d requests", len(request_ids))
        for entry in self.registry.loaded_entries():
            for request_id in request_ids:  # abort is idempotent and ignores ids its engine does not hold
                entry.engine.abort(request_id)
        # Aborted streams end with finish_reason "abort"; give them a moment to send it.
        await self.admission.wait_idle(2.0)


# API routes outside /v1/, /v2/ and /api/ (the rerank API answers at /rerank as llama.cpp's does).
_UNVERSIONED_API_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/rerank"})


class GuardMiddleware:
    """API keys, body size and body time limits and the per-status counter, in front of every route."""

    def __init__(self, app: ASGIApp, state: ServerState, key_checker: ApiKeyChecker):
        self.app = app
        self.state = state
        self.key_checker = key_checker

    def _is_protected(self, path: str) -> bool:
        if path in ("/health", "/metrics", "/v1/engine/stats"):
            return self.state.settings.protect_metrics
        return path.startswith(("/v1/", "/v2/", "/api/")) or path in _UNVERSIONED_API_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.state.metrics

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                metrics.observe_http_status(message["status"])
            await send(message)

        headers = {key.decode("latin-1").lower(): value.decode("latin-1") for key, value in scope["headers"]}
        try:
            if scope["method"] != "OPTIONS" and self._is_protected(scope["path"]):
                self.key_checker.check_headers(headers.get("authorization"), headers.get("x-api-key"))
            max_body_size = self.state.settings.max_body_size
            declared_size = headers.get("content-length")
            if declared_size and declared_size.isdigit() and int(declared_size) > max_body_size:
                raise RequestTooLargeError(max_body_size)
        except TokiosError as exc:
            response = error_response(exc, dialect_of_path(scope["path"]))
            if exc.status == 401:
                response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, counting_send)
            return

        num_body_bytes = 0
        body_deadline = BodyDeadline(self.state.settings.request_body_timeout_s)

        async def limited_receive() -> Message:
            nonlocal num_body_bytes
            message = await body_deadline.receive(receive)
            if message["type"] == "http.request":
                num_body_bytes += len(message.get("body", b""))
                if num_body_bytes > max_body_size:  # chunked bodies carry no Content-Length
                    raise RequestTooLargeError(max_body_size)
            return message

        await self.app(scope, limited_receive, counting_send)


def process_stats() -> dict[str, int]:
    """What a leak would grow: resident memory, open descriptors, live asyncio tasks (the soak
    test, tools/soak.py, reads these before and after thousands of requests)."""
    with open("/proc/self/statm") as handle:
        resident_pages = int(handle.read().split()[1])
    return {"rss_bytes": resident_pages * os.sysconf("SC_PAGE_SIZE"),
            "num_open_fds": len(os.listdir("/proc/self/fd")),
            "num_asyncio_tasks": len(asyncio.all_tasks())}


def create_app(settings: ServerSettings, *, registry: ModelRegistry | None = None,
               engine_loader: Callable[[], Any] | None = None, api_keys: ApiKeyChecker | None = None) -> FastAPI:
    """The app around a registry, or (`engine_loader`) around one model that loader builds."""
    if (registry is None) == (engine_loader is None):
        raise ValueError("create_app needs exactly one of registry and engine_loader")
    if registry is None:
        names = settings.served_model_names or ["default"]
        registry = ModelRegistry([ModelSpec(names=list(names), path="", load=engine_loader)])
    state = ServerState(settings, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start_task = asyncio.create_task(state.start())
        yield
        if not start_task.done():
            await asyncio.gather(start_task, return_exceptions=True)
        for task in state.companion_tasks:
            task.cancel()
        await asyncio.gather(*state.companion_tasks, return_exceptions=True)
        await state.registry.shutdown()

    app = FastAPI(title="tokios", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tokios = state
    app.add_middleware(GuardMiddleware, state=state, key_checker=api_keys or ApiKeyChecker())

    async def handle_error(request: Request, exc: Exception) -> Response:
        return error_response(exc, dialect_of_path(request.url.path))

    for exception_type in (TokiosError, ValidationError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exception_type, handle_error)

    @app.get("/health")
    async def health(generate: bool = False) -> Response:
        status_code, body = await state.generation_probe() if generate else state.health()
        headers = {} if status_code == 200 else {"Retry-After": retry_after_header(settings.retry_after_s)}
        return JSONResponse(body, status_code=status_code, headers=headers)

    openapi_document: dict[str, Any] = {}

    @app.get("/openapi.json")
    async def openapi() -> Response:
        if not openapi_document:
            from tokios import __version__
            from tokios.server.openapi import build_openapi

            openapi_document.update(build_openapi("tokios", __version__, settings.protect_metrics,
                                                  state.registry.accepted_names))
        return JSONResponse(openapi_document)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/engine/cache_events")
    async def cache_events(model: str | None = None, since: int = -1, log_id: str = "") -> Response:
        """For the gateway connector's --report-cache-events (gateway/prefix_index.py)."""
        state.check_ready()
        entry = state.registry.entry(model)
        if entry.serving is None:  # an unloaded model holds no blocks
            return JSONResponse({"model": entry.name, "log_id": "", "next": 0, "reset": True, "block_size": 0,
                                 "root_hash": "", "stored": [], "removed": []})
        return JSONResponse({"model": entry.name, **entry.serving.engine.cache_events(since, log_id)})

    @app.get("/v1/engine/stats")
    async def engine_stats(model: str | None = None) -> Response:
        state.check_ready()
        entry = state.registry.entry(model)
        serving = entry.serving
        if serving is None:
            raise OverloadedError(f"The model {entry.name!r} is not loaded (state {entry.state}).", status=503,
                                  retry_after_s=settings.retry_after_s)
        stats = dataclasses.asdict(serving.engine.stats())
        stats["model"] = entry.name
        stats["num_unfinished_requests"] = serving.engine.num_unfinished_requests
        stats["num_requests_in_flight"] = state.admission.num_in_flight
        stats["process"] = process_stats()
        stats["invariants_error"] = None
        if stats["num_unfinished_requests"] == 0:
            try:
                serving.engine.check_invariants()
            except Exception as exc:  # reported, not raised: this endpoint exists to show it
                stats["invariants_error"] = str(exc) or type(exc).__name__
        return JSONResponse(stats)

    for dialect in DIALECTS:
        for route in dialect.routes:
            app.add_api_route(route.path, route.handler, methods=[route.method.upper()])

    @app.get("/")
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache",
                                                                "Content-Security-Policy": CONTENT_SECURITY_POLICY})

    # Browsers and tools ask for /favicon.ico whatever the page links; the page's icon is an SVG.
    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return FileResponse(FAVICON_FILE, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/static/vendor/{name}")
    async def vendor(name: str) -> Response:
        path = vendor_file(name)
        if path is None:
            raise StarletteHTTPException(404, f"no web page library named {name!r} is installed")
        return FileResponse(path, headers={"Cache-Control": "max-age=86400"})

    warn_if_vendor_files_missing()

    app.mount("/static", PageFiles(directory=STATIC_DIR), name="static")
    return app
