"""The FastAPI application: routes, the guard middleware, lifespan (engine loading) and draining.

`create_app(settings, engine=..., engine_loader=...)` builds the app around a ready AsyncEngine
or loads one in a worker thread after the server is listening (so `/health` answers 503 while
loading). Routes parse bodies themselves (JSON object -> pydantic model) so that every malformed
body becomes a 400 in OpenAI's shape via server/errors.py; endpoint logic is in server/serving.py.
GuardMiddleware (pure ASGI, so streaming and disconnects pass through untouched) checks API keys,
enforces --max-body-size and counts responses by status. `ServerState.drain()` is the SIGTERM path
used by server/cli.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokios.errors import InvalidRequestError, OverloadedError, TokiosError
from tokios.server.admission import Admission
from tokios.server.auth import ApiKeyChecker
from tokios.server.connection_limits import BodyDeadline
from tokios.server.errors import RequestTooLargeError, error_response
from tokios.server.metrics import CONTENT_TYPE, ServerMetrics
from tokios.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokios.server.serving import Serving, ServerSettings

logger = logging.getLogger("tokios.server")
STATIC_DIR = Path(__file__).parent / "static"
ModelT = TypeVar("ModelT", bound=BaseModel)


class ServerState:
    """What the routes share: settings, metrics, admission, and the engine once it is ready."""

    def __init__(self, settings: ServerSettings, engine: Any | None, engine_loader: Callable[[], Any] | None):
        if (engine is None) == (engine_loader is None):
            raise ValueError("create_app needs exactly one of engine and engine_loader")
        self.settings = settings
        self.engine = engine
        self.engine_loader = engine_loader
        self.serving: Serving | None = None
        self.load_error: BaseException | None = None
        self.on_load_failure: Callable[[], None] = lambda: None
        self.metrics = ServerMetrics(self.engine_stats)
        self.admission = Admission(settings.max_num_seqs, settings.max_queued_requests, settings.retry_after_s)
        # Tasks that run beside the server once the model is ready (e.g. the gateway connector of
        # `tokios serve --connect`), and what each wants done when draining starts.
        self.companions: list[Callable[["ServerState"], Any]] = []
        self.companion_tasks: list[asyncio.Task] = []
        self.on_drain: list[Callable[[], None]] = []
        # Set when the engine failed for good (a step raised); the CLI exits non-zero.
        self.engine_failure: BaseException | None = None
        self.on_engine_failure: Callable[[], None] = lambda: None
        self._is_stall_logged = False

    def engine_stats(self) -> Any | None:
        return self.serving.engine.stats() if self.serving else None

    def ready_serving(self) -> Serving:
        if self.serving is None:
            raise OverloadedError("The model is still loading.", status=503, retry_after_s=self.settings.retry_after_s)
        return self.serving

    async def start(self) -> None:
        if self.engine is None:
            try:
                self.engine = await asyncio.to_thread(self.engine_loader)
            except BaseException as exc:  # the CLI reports it and exits non-zero
                self.load_error = exc
                logger.error("loading the model failed: %s", getattr(exc, "message", exc))
                self.on_load_failure()
                return
        self.engine.start()
        loop = asyncio.get_running_loop()
        self.engine.on_failure = lambda error: loop.call_soon_threadsafe(self._engine_failed, error)
        self.serving = Serving(self.engine, self.settings, self.metrics, self.admission)
        logger.info("model %s ready (max_model_len %d)", self.engine.model_name, self.engine.max_model_len)
        self.companion_tasks = [asyncio.create_task(companion(self)) for companion in self.companions]

    def _engine_failed(self, error: BaseException) -> None:
        self.engine_failure = error
        logger.error("the engine failed (%s); every request in flight got the error; the server exits",
                     getattr(error, "message", error))
        self.on_engine_failure()

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status code, body) of GET /health: cheap, but 503 unless the engine is making progress."""
        if self.admission.is_draining:
            return 503, {"status": "draining"}
        if self.serving is None:
            return 503, {"status": "loading" if self.load_error is None else "failed"}
        engine = self.serving.engine
        if self.engine_failure is not None or not engine.is_alive:
            error = self.engine_failure or engine.failure
            return 503, {"status": "failed", "error": str(getattr(error, "message", error) or "engine thread gone")}
        stall = engine.stall_report(self.settings.stall_timeout_s)
        if stall is not None:
            summary, stack = stall
            if not self._is_stall_logged:  # once per stall, with the stack; the next ok resets it
                logger.error("health: %s. Engine thread stack:\n%s", summary, stack)
                self._is_stall_logged = True
            return 503, {"status": "stalled", "error": summary}
        self._is_stall_logged = False
        return 200, {"status": "ok"}

    async def generation_probe(self) -> tuple[int, dict[str, Any]]:
        """GET /health?generate=1: one greedy token through the engine, within a deadline."""
        status, body = self.health()
        if status != 200:
            return status, body
        from tokios.sampling_params import SamplingParams

        engine = self.serving.engine
        timeout_s = self.settings.health_generate_timeout_s
        started = time.monotonic()

        async def one_token() -> int:
            num_tokens = 0
            async for output in engine.generate(None, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                                prompt_token_ids=engine.tokenizer.encode("Hello")):
                num_tokens = len(output.outputs[0].token_ids)
            return num_tokens

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
        for request_id in request_ids:
            self.engine.abort(request_id)
        # Aborted streams end with finish_reason "abort"; give them a moment to send it.
        await self.admission.wait_idle(2.0)


class GuardMiddleware:
    """API keys, body size and body time limits and the per-status counter, in front of every route."""

    def __init__(self, app: ASGIApp, state: ServerState, key_checker: ApiKeyChecker):
        self.app = app
        self.state = state
        self.key_checker = key_checker

    def _is_protected(self, path: str) -> bool:
        if path in ("/health", "/metrics", "/v1/engine/stats"):
            return self.state.settings.protect_metrics
        return path.startswith("/v1/") or path in ("/tokenize", "/detokenize")

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
            response = error_response(exc)
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


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequestError("The request body is empty; send a JSON object.", param=None)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"The request body is not valid JSON: {exc}", param=None) from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"The request body must be a JSON object, got {type(data).__name__}.", param=None)
    return model.model_validate(data)


def create_app(settings: ServerSettings, *, engine: Any | None = None,
               engine_loader: Callable[[], Any] | None = None, api_keys: ApiKeyChecker | None = None) -> FastAPI:
    state = ServerState(settings, engine, engine_loader)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        start_task = asyncio.create_task(state.start())
        yield
        if not start_task.done():
            await asyncio.gather(start_task, return_exceptions=True)
        for task in state.companion_tasks:
            task.cancel()
        await asyncio.gather(*state.companion_tasks, return_exceptions=True)
        if state.engine is not None and state.serving is not None:
            await state.engine.shutdown()

    app = FastAPI(title="tokios", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tokios = state
    app.add_middleware(GuardMiddleware, state=state, key_checker=api_keys or ApiKeyChecker())

    async def handle_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    for exception_type in (TokiosError, ValidationError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(exception_type, handle_error)

    @app.get("/health")
    async def health(generate: bool = False) -> Response:
        status_code, body = await state.generation_probe() if generate else state.health()
        headers = {} if status_code == 200 else {"Retry-After": str(int(max(1, settings.retry_after_s)))}
        return JSONResponse(body, status_code=status_code, headers=headers)

    openapi_document: dict[str, Any] = {}

    @app.get("/openapi.json")
    async def openapi() -> Response:
        if not openapi_document:
            from tokios import __version__
            from tokios.server.openapi import build_openapi

            openapi_document.update(build_openapi("tokios", __version__, settings.protect_metrics))
        return JSONResponse(openapi_document)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/engine/stats")
    async def engine_stats() -> Response:
        serving = state.ready_serving()
        stats = dataclasses.asdict(serving.engine.stats())
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

    @app.get("/v1/models")
    async def list_models() -> Response:
        return JSONResponse(state.ready_serving().models())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        serving = state.ready_serving()
        state.admission.check_accepting()
        return await serving.chat(request, await parse_body(request, ChatCompletionRequest))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        serving = state.ready_serving()
        state.admission.check_accepting()
        return await serving.completions(request, await parse_body(request, CompletionRequest))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        serving = state.ready_serving()
        return JSONResponse(serving.tokenize(await parse_body(request, TokenizeRequest)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        serving = state.ready_serving()
        return JSONResponse(serving.detokenize(await parse_body(request, DetokenizeRequest)))

    @app.get("/")
    async def index() -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
