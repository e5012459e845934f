"""`tokios gateway`: run the gateway; `tokios gateway status`: show its backends;
`tokios gateway bench`: measure its overhead against calling a backend directly.

Wires command-line options to gateway/app.py (served by uvicorn, TLS when given a certificate and
key), and to gateway/bench.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tokios.errors import InvalidRequestError
from tokios.server.connection_limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, DEFAULT_MAX_CONNECTIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--db", default=None, help="key store (default $TOKIOS_GATEWAY_DB or ~/.local/share/tokios/gateway.db)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS certificate (PEM); serve HTTPS/WSS with --ssl-keyfile")
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--max-body-bytes", type=int, default=1024 * 1024)
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--dead-after-s", type=float, default=25.0)
    parser.add_argument("--cool-down-s", type=float, default=30.0)
    parser.add_argument("--max-attempts", type=int, default=3, help="backends tried before the first byte")
    parser.add_argument("--request-header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                        help=f"close a connection whose request headers are late (default {DEFAULT_HEADER_TIMEOUT_S:g} s)")
    parser.add_argument("--request-body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                        help=f"408 for a body that has not arrived in time (default {DEFAULT_BODY_TIMEOUT_S:g} s)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help=f"open connections at most, connectors included (default {DEFAULT_MAX_CONNECTIONS})")
    routing = parser.add_argument_group("prefix-aware routing (docs/gateway.md; defaults are SGLang router's)")
    routing.add_argument("--routing", choices=["prefix", "least-busy"], default="prefix",
                         help="prefix: to the backend holding the longest cached part of the prompt (for models with "
                              "--tokenizer and backends that --report-cache-events), else the least busy")
    routing.add_argument("--tokenizer", action="append", default=[], metavar="MODEL=PATH",
                         help="the model file (GGUF or model directory) whose tokenizer and chat template the "
                              "backends of MODEL use; repeatable")
    routing.add_argument("--cache-threshold", type=float, default=0.3,
                         help="route by prefix when a backend holds at least this share of the prompt (default 0.3)")
    routing.add_argument("--balance-abs-threshold", type=int, default=64,
                         help="loads are uneven when the busiest has more than this many requests over the idlest "
                              "(default 64) ...")
    routing.add_argument("--balance-rel-threshold", type=float, default=1.5,
                         help="... and more than this many times its count (default 1.5); then route by load")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    actions = parser.add_subparsers(dest="action", metavar="ACTION")

    status = actions.add_parser("status", help="show connected backends of a running gateway")
    status.add_argument("--url", default="http://127.0.0.1:8080")
    status.add_argument("--api-key", default=None, help="a client key (default $TOKIOS_API_KEY)")

    bench = actions.add_parser("bench", help="added TTFT and throughput ratio: gateway vs direct")
    bench.add_argument("--direct-url", required=True, help="the backend, e.g. http://127.0.0.1:8000")
    bench.add_argument("--direct-api-key", default=None)
    bench.add_argument("--gateway-url", required=True, help="the gateway, e.g. http://127.0.0.1:8080")
    bench.add_argument("--api-key", default=None, help="a client key of the gateway (default $TOKIOS_API_KEY)")
    bench.add_argument("--model", required=True)
    bench.add_argument("--concurrency", type=int, default=16)
    bench.add_argument("--num-requests", type=int, default=64, help="requests per round and target")
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--num-rounds", type=int, default=3, help="alternating direct/gateway rounds")
    bench.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    if args.action == "status":
        return _status(args)
    if args.action == "bench":
        return _bench(args)
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from tokios.gateway import protocol
    from tokios.gateway.app import GatewayConfig, create_app
    from tokios.gateway.keys import KeyStore, default_db_path
    from tokios.gateway.router import PrefixPolicy
    from tokios.server.connection_limits import header_timeout_protocol, raise_open_file_limit

    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise InvalidRequestError("--ssl-certfile and --ssl-keyfile must be given together", param="ssl_certfile")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = GatewayConfig(
        max_body_bytes=args.max_body_bytes,
        heartbeat_s=args.heartbeat_s,
        dead_after_s=args.dead_after_s,
        cool_down_s=args.cool_down_s,
        max_attempts=args.max_attempts,
        request_body_timeout_s=args.request_body_timeout,
        prefix_policy=PrefixPolicy(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold)
        if args.routing == "prefix" else None,
        model_to_tokenizer_path=_model_to_tokenizer_path(args.tokenizer),
    )
    for name in ("request_header_timeout", "request_body_timeout"):
        if not getattr(args, name) > 0:
            raise InvalidRequestError(f"{name} must be > 0", param=name)
    raise_open_file_limit(args.max_connections + 256)
    key_store = KeyStore(args.db or default_db_path())
    app = create_app(config, key_store)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        ws_max_size=protocol.MAX_MESSAGE_BYTES,
        http=header_timeout_protocol(args.request_header_timeout),
        limit_concurrency=args.max_connections,
    )
    return 0


def _model_to_tokenizer_path(values: list[str]) -> dict[str, str]:
    model_to_path = {}
    for value in values:
        model, separator, path = value.partition("=")
        if not separator or not model or not path:
            raise InvalidRequestError(f"tokenizer must be MODEL=PATH, got {value!r}", param="tokenizer")
        if not os.path.exists(path):
            raise InvalidRequestError(f"tokenizer: {path!r} is not a file or directory here", param="tokenizer")
        model_to_path[model] = path
    return model_to_path


def _status(args: argparse.Namespace) -> int:
    import httpx

    api_key = args.api_key or os.environ.get("TOKIOS_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(args.url.rstrip("/") + "/status", headers=headers, timeout=10.0, trust_env=False)
    except httpx.HTTPError as exc:
        print(f"tokios gateway status: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if response.status_code != 200:
        print(f"tokios gateway status: HTTP {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    status = response.json()
    print(f"{status['num_backends']} backend(s); models: {', '.join(status['models']) or '-'}")
    for backend in status["backends"]:
        flags = [name for name in ("is_draining", "is_cooling") if backend.get(name)]
        print(
            f"  {backend['backend_id']}: models={','.join(backend['models'])} in_flight={backend['num_in_flight']}"
            + (f" [{' '.join(flags)}]" if flags else "")
        )
    return 0


def _bench(args: argparse.Namespace) -> int:
    import asyncio

    from tokios.gateway.bench import LoadSpec, compare, format_comparison

    spec = LoadSpec(
        model=args.model,
        concurrency=args.concurrency,
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
    )
    result = asyncio.run(
        compare(
            spec,
            direct_url=args.direct_url,
            direct_api_key=args.direct_api_key,
            gateway_url=args.gateway_url,
            gateway_api_key=args.api_key or os.environ.get("TOKIOS_API_KEY"),
            num_rounds=args.num_rounds,
        )
    )
    print(json.dumps(result, indent=2) if args.json else format_comparison(result))
    return 0
