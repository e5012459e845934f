"""`tokios serve`: flags -> EngineConfig + ServerSettings -> uvicorn on a bound socket.

Owns the command line of the server (the engine's flags are engine_flags.py's, shared
with the other commands that build an engine), the listening socket (bound before the model
loads, so the port is known at once and `/health` answers 503 while loading; `--port 0` picks a
free port, printed as `tokios serve: listening on http://HOST:PORT`), logging setup, and signal
handling: the first SIGTERM/SIGINT starts draining (server/app.py ServerState.drain) and the
process exits when in-flight requests are done or --shutdown-timeout has passed; a second signal
exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from tokios import sampling_defaults
from tokios.engine_flags import add_engine_arguments, engine_config_from_args
from tokios.errors import InvalidRequestError
from tokios.reasoning.formats import FORMAT_CHOICES
from tokios.server.connection_limits import (DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S,
                                             DEFAULT_MAX_CONNECTIONS, header_timeout_protocol, raise_open_file_limit)

DEFAULT_MAX_BODY_SIZE = "8MiB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    net.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    served = parser.add_argument_group("models served (flags of the engine that runs each follow)")
    served.add_argument("--model", action="append", default=None, metavar="PATH[=NAME]",
                        help="GGUF file or model directory, optionally with the name clients use; repeatable: "
                             "the first is the default model and loads at start, the others on demand "
                             "(default: SmolLM2-135M-Instruct)")
    served.add_argument("--models-dir", default=None,
                        help="also serve every model in this directory (*.gguf files and model directories), "
                             "named after their files, loaded on demand")
    add_engine_arguments(parser)
    sampling_defaults.add_arguments(parser, applies_to="every request that leaves them unset, in every API")
    models = parser.add_argument_group("several models (docs/apis.md)")
    models.add_argument("--keep-alive", default=None,
                        help="unload a model idle this long, e.g. 5m, 1h, 30s, 0 (at once), -1 (never); "
                             "per request in the Ollama API (default: 5m with several models, never with one)")
    models.add_argument("--max-loaded-models", type=int, default=None,
                        help="models loaded at once; loading one more unloads the least recently used idle one "
                             "(default: no limit)")
    models.add_argument("--max-model-memory", default=None,
                        help="memory the loaded models may take together (weights + KV cache, as tokios plan "
                             "counts them), e.g. 8GiB; the least recently used idle models are unloaded to fit "
                             "(default: no limit)")
    server = parser.add_argument_group("server")
    server.add_argument("--served-model-name", action="append", default=None,
                        help="name(s) clients use in `model` (default: the model's name); repeatable")
    server.add_argument("--api-key", action="append", default=None,
                        help="accept this API key (repeatable); without keys the server is open")
    server.add_argument("--api-key-file", default=None, help="file with one API key a line")
    server.add_argument("--protect-metrics", action="store_true",
                        help="require a key for /health, /metrics and /v1/engine/stats too")
    server.add_argument("--max-body-size", default=DEFAULT_MAX_BODY_SIZE,
                        help=f"largest request body, e.g. 8MiB (default {DEFAULT_MAX_BODY_SIZE})")
    server.add_argument("--max-queued-requests", type=int, default=1024,
                        help="requests that may wait beyond --max-num-seqs; more get 429 (default 1024)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    server.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help="close a connection whose request headers have not arrived within this many "
                             f"seconds (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    server.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help="answer 408 to a request whose body has not fully arrived within this many "
                             f"seconds (default {DEFAULT_BODY_TIMEOUT_S:g})")
    server.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections at most; requests beyond get 503 "
                             f"(default {DEFAULT_MAX_CONNECTIONS})")
    server.add_argument("--stall-timeout", type=float, default=60.0,
                        help="/health answers 503 when requests wait and the engine's step loop has not "
                             "advanced for this many seconds (default 60)")
    server.add_argument("--health-generate-timeout", type=float, default=10.0,
                        help="deadline in seconds of the one-token generation of GET /health?generate=1 "
                             "(default 10)")
    server.add_argument("--pooling", default="mean", choices=["mean", "last"],
                        help="how /v1/embeddings and /api/embed pool a chat model's final hidden states (default "
                             "mean); an embedding model pools as its file declares")
    server.add_argument("--reasoning-format", default="auto", choices=list(FORMAT_CHOICES),
                        help="how a reasoning model's output splits into thinking and answer: think (<think> "
                             "blocks), harmony (gpt-oss channels), none; auto reads it from the chat template "
                             "and vocabulary (default auto)")
    server.add_argument("--responses-store-size", type=int, default=1000,
                        help="responses the OpenAI Responses API keeps for previous_response_id (default 1000)")
    server.add_argument("--responses-store-ttl", default="1h",
                        help="how long a stored response is kept, e.g. 1h, 30m (default 1h)")
    server.add_argument("--log-requests", action=argparse.BooleanOptionalAction, default=True,
                        help="log one line per finished request to logger tokios.requests (default on)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def model_arguments(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(path, name or None) of every model the flags name: each --model, then --models-dir's."""
    from tokios.model_files import installed_model_names, resolve_model_path

    models: list[tuple[str, str | None]] = []
    for value in args.model or []:
        path, separator, name = value.rpartition("=")
        if not separator or not path:
            path, name = value, ""
        if separator and not name:
            raise InvalidRequestError(f"model: {value!r} gives an empty name after '='", param="model")
        resolved = resolve_model_path(path)
        if not os.path.exists(resolved):
            # Before the port is bound or anything announced: nothing is downloaded at run time.
            raise InvalidRequestError(f"model: {path!r} is not a file or directory here (a GGUF file, a model "
                                      f"directory, or an installed model's file name: {installed_model_names()})",
                                      param="model")
        models.append((resolved, name or None))
    if args.models_dir is not None:
        directory = Path(args.models_dir)
        if not directory.is_dir():
            raise InvalidRequestError(f"models_dir: {args.models_dir!r} is not a directory", param="models_dir")
        found = sorted(path for path in directory.iterdir()
                       if (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file()))
        if not found and not models:
            raise InvalidRequestError(f"models_dir: {args.models_dir!r} holds no *.gguf file or model directory",
                                      param="models_dir")
        models.extend((str(path), None) for path in found)
    if not models:
        models.append((resolve_model_path(None), None))
    return models


def build_registry(args: argparse.Namespace):
    """The model registry of the flags; every engine flag is validated before anything loads."""
    from tokios.config import parse_duration, parse_size
    from tokios.engine.async_engine import served_model_name
    from tokios.load_progress import progress_delay_s
    from tokios.server.registry import ModelRegistry, ModelSpec
    from tokios.tokenizer.tokenizer import has_chat_template

    progress_delay_s()  # a bad $TOKIOS_LOAD_PROGRESS_DELAY_S is an error at start, not at each later load
    models = model_arguments(args)
    if args.served_model_name and len(models) > 1:
        raise InvalidRequestError("served_model_name names a single model; with several, name each as "
                                  "--model PATH=NAME", param="served_model_name")
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1 and len(models) > 1:
        raise InvalidRequestError("a tensor/pipeline parallel group serves one model; run one server per model "
                                  "(behind a gateway)", param="tensor_parallel_size")
    kv_cache_bytes = parse_size(args.kv_cache_memory, field_name="kv_cache_memory")
    specs = []
    name_to_path: dict[str, str] = {}
    for path, name in models:
        names = [name or served_model_name(path)]
        if len(models) == 1 and args.served_model_name:
            names = list(args.served_model_name)
        for each in names:
            if each in name_to_path:
                raise InvalidRequestError(f"model: the name {each!r} is given to both {name_to_path[each]} and {path}; "
                                          "name them with --model PATH=NAME", param="model")
            name_to_path[each] = path
        config = engine_config_from_args(args, model=path)
        kind, is_encoder = _kind_of(path)
        specs.append(ModelSpec(names=names, path=path, load=_engine_loader(config, is_encoder=is_encoder),
                               estimated_bytes=_estimated_bytes(path, kv_cache_bytes), kind=kind,
                               sampling_defaults=sampling_defaults.from_args(args, path),
                               has_chat_template=config.load.chat_template is not None or has_chat_template(path)))
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise InvalidRequestError("max_loaded_models must be >= 1", param="max_loaded_models")
    keep_alive_s = None if args.keep_alive is None else parse_duration(args.keep_alive, field_name="keep_alive")
    max_memory = None if args.max_model_memory is None else parse_size(args.max_model_memory,
                                                                        field_name="max_model_memory")
    return ModelRegistry(specs, keep_alive_s=keep_alive_s, max_loaded_models=args.max_loaded_models,
                         max_memory_bytes=max_memory)


def _kind_of(path: str) -> tuple[str, bool]:
    """(what the model serves, whether it runs on the encoder engine), from its metadata. A file
    that cannot be read counts as a generative model: its load reports what is wrong with it,
    as for any other model, without keeping the server from starting."""
    from tokios.encoder.loader import GENERATE, encoder_architecture, model_kind

    try:
        return model_kind(path), encoder_architecture(path) is not None
    except Exception:
        return GENERATE, False


def _engine_loader(config, *, is_encoder: bool):
    def load():
        if is_encoder:
            from tokios.encoder.engine import EncoderEngine

            return EncoderEngine(config)
        from tokios.engine import AsyncEngine

        return AsyncEngine(config)
    return load


def _estimated_bytes(path: str, kv_cache_bytes: int) -> int | None:
    """The file's weight bytes (its shape's count) plus the KV cache it will allocate."""
    from tokios.model.shape import read_model_shape

    try:
        shape = read_model_shape(path)
    except Exception:  # the load reports what is wrong with the file
        return None
    if shape.file_weight_bytes is None:
        return None
    return shape.file_weight_bytes + kv_cache_bytes


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise InvalidRequestError(f"port: cannot listen on {host}:{port}: {exc.strerror}", param="port") from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace, on_listening: Callable[[Any, int], None] | None = None) -> int:
    """Serves until stopped; `on_listening(state, port)` runs once the socket is bound, before the
    model loads (`tokios serve --connect` attaches the gateway connector there: commands/serve.py)."""
    from tokios.config import parse_duration, parse_size
    from tokios.server.app import create_app
    from tokios.server.auth import ApiKeyChecker
    from tokios.server.serving import ServerSettings

    if not 0 <= args.port <= 65535:
        raise InvalidRequestError(f"port: {args.port} is not a TCP port (0-65535; 0 picks a free one)", param="port")

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_queued_requests < 0:
        raise InvalidRequestError("max_queued_requests must be >= 0", param="max_queued_requests")
    for name in ("shutdown_timeout", "stall_timeout", "health_generate_timeout"):
        if getattr(args, name) < 0:
            raise InvalidRequestError(f"{name} must be >= 0", param=name)
    for name in ("request_header_timeout", "request_body_timeout"):
        if not getattr(args, name) > 0:
            raise InvalidRequestError(f"{name} must be > 0", param=name)
    if args.responses_store_size < 0:
        raise InvalidRequestError("responses_store_size must be >= 0", param="responses_store_size")
    if args.max_connections < 1:
        raise InvalidRequestError("max_connections must be >= 1", param="max_connections")
    registry = build_registry(args)  # validates every engine flag before anything loads
    settings = ServerSettings(
        served_model_names=args.served_model_name,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        max_body_size=parse_size(args.max_body_size, field_name="max_body_size"),
        shutdown_timeout_s=args.shutdown_timeout,
        protect_metrics=args.protect_metrics,
        log_requests=args.log_requests,
        stall_timeout_s=args.stall_timeout,
        health_generate_timeout_s=args.health_generate_timeout,
        request_body_timeout_s=args.request_body_timeout,
        pooling=args.pooling,
        reasoning_format=args.reasoning_format,
        responses_store_size=args.responses_store_size,
        responses_store_ttl_s=parse_duration(args.responses_store_ttl, field_name="responses_store_ttl"),
    )
    api_keys = ApiKeyChecker.from_sources(args.api_key, args.api_key_file)

    app = create_app(settings, registry=registry, api_keys=api_keys)
    state = app.state.tokios
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    if on_listening is not None:
        on_listening(state, port)
    display_host = f"[{host}]" if ":" in host else host
    print(f"tokios serve: listening on http://{display_host}:{port}"
          f"{' (API key required)' if api_keys.is_enabled else ''}", file=sys.stderr, flush=True)

    # Room for every allowed connection plus the model files, logs and the gateway link.
    raise_open_file_limit(args.max_connections + 256)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5, timeout_keep_alive=5,
                            http=header_timeout_protocol(args.request_header_timeout),
                            limit_concurrency=args.max_connections)
    server = DrainingServer(config, state)
    state.on_load_failure = lambda: setattr(server, "should_exit", True)
    state.on_engine_failure = lambda: setattr(server, "should_exit", True)
    server.run(sockets=[sock])
    error = state.load_error or state.engine_failure
    if error is not None:
        print(f"tokios serve: error: {getattr(error, 'message', error)}", file=sys.stderr)
        return 1
    return 0


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server whose first exit signal drains instead of closing the listening socket."""

    def __init__(self, config: uvicorn.Config, state) -> None:
        super().__init__(config)
        self._state = state
        self._is_drain_requested = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._is_drain_requested or not self._state.is_ready:
            # A second signal, or nothing to drain yet: exit now (uvicorn's own behaviour).
            super().handle_exit(sig, frame)
            return
        # Runs inside the signal handler: only set a flag; on_tick starts the drain in the loop.
        self._is_drain_requested = True

    async def on_tick(self, counter: int) -> bool:
        if self._is_drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        try:
            await self._state.drain()
        finally:
            self.should_exit = True
