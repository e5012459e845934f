"""`tokios connect URL`: give a local OpenAI-compatible backend a stable address on a gateway.

Wires options to gateway/connector.py and turns SIGTERM/SIGINT into a drain: the gateway stops
routing new work here and in-flight streams finish within --drain-grace-s. Also here, for
`tokios serve --connect` (commands/serve.py): the same connector as a companion of the server,
dialling out once the model is ready and draining with it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

from typing import TYPE_CHECKING

from tokios.errors import InvalidRequestError

if TYPE_CHECKING:
    from tokios.gateway.connector import ConnectorConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gateway_url", help="the gateway, e.g. https://gw.example.com or ws://127.0.0.1:8080")
    parser.add_argument("--token", default=None, help="connector token (default $TOKIOS_CONNECTOR_TOKEN; prefer the env var)")
    parser.add_argument("--backend-url", default="http://127.0.0.1:8000", help="the local OpenAI-compatible server")
    parser.add_argument("--backend-api-key", default=None, help="key of the local server (default $TOKIOS_BACKEND_API_KEY)")
    parser.add_argument("--backend-id", default="", help="stable id of this backend (default <hostname>-<port>)")
    parser.add_argument("--models", default="", help="comma-separated models served (default: ask /v1/models)")
    parser.add_argument("--ca-file", default=None, help="CA certificate to trust for a wss:// gateway")
    parser.add_argument("--heartbeat-s", type=float, default=10.0)
    parser.add_argument("--dead-after-s", type=float, default=25.0)
    parser.add_argument("--max-backoff-s", type=float, default=8.0)
    parser.add_argument("--drain-grace-s", type=float, default=30.0)
    parser.add_argument("--report-cache-events", action="store_true",
                        help="tell the gateway which prompt prefixes the backend has cached, for prefix-aware routing "
                             "(polls the backend's /v1/engine/cache_events; docs/gateway.md)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> ConnectorConfig:
    # The connector (websockets, httpx) is imported when it runs, not when `tokios serve` parses flags.
    from tokios.gateway.connector import REPORT_CACHE_EVENTS_INTERVAL_S, ConnectorConfig

    return ConnectorConfig(
        gateway_url=args.gateway_url,
        token=args.token or os.environ.get("TOKIOS_CONNECTOR_TOKEN", ""),
        backend_url=args.backend_url,
        backend_id=args.backend_id,
        models=tuple(m.strip() for m in args.models.split(",") if m.strip()),
        backend_api_key=args.backend_api_key or os.environ.get("TOKIOS_BACKEND_API_KEY"),
        heartbeat_s=args.heartbeat_s,
        dead_after_s=args.dead_after_s,
        max_backoff_s=args.max_backoff_s,
        drain_grace_s=args.drain_grace_s,
        ca_file=args.ca_file,
        cache_events_interval_s=REPORT_CACHE_EVENTS_INTERVAL_S if args.report_cache_events else 0.0,
    )


def run(args: argparse.Namespace) -> int:
    from tokios.gateway.connector import Connector

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # One line per proxied request would drown the connector's own messages.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    connector = Connector(config_from_args(args))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for signal_number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signal_number, connector.request_drain)
        await connector.run()

    asyncio.run(main())
    return 0


# ---- tokios serve --connect ---------------------------------------------------------------------

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("gateway")
    group.add_argument("--connect", metavar="GATEWAY_URL", default=None,
                       help="also connect this server to a tokios gateway (ws:// or wss://), as `tokios connect` "
                            "does; the connector token comes from $TOKIOS_CONNECTOR_TOKEN")
    group.add_argument("--backend-id", default="", help="stable backend id to register with --connect")
    group.add_argument("--report-cache-events", action="store_true",
                       help="with --connect: tell the gateway which prompt prefixes are cached here, for its "
                            "prefix-aware routing (docs/gateway.md)")


def check_serve_arguments(args: argparse.Namespace) -> None:
    if args.report_cache_events and not args.connect:
        raise InvalidRequestError("report_cache_events reports to a gateway: give --connect GATEWAY_URL too",
                                  param="report_cache_events")
    if args.connect and not os.environ.get("TOKIOS_CONNECTOR_TOKEN", ""):
        raise InvalidRequestError("--connect needs a connector token in $TOKIOS_CONNECTOR_TOKEN "
                                  "(create one with `tokios keys create --kind connector`)", param="connect")


def attach_to_server(state, args: argparse.Namespace, port: int) -> None:
    """`--connect`: once the model is ready, dial the gateway and carry its requests to this
    server over loopback; on SIGTERM tell the gateway to send no more work. `state` is the
    server's (server/app.py ServerState): its companions run beside it, its drain hooks on SIGTERM."""
    from tokios.gateway.connector import REPORT_CACHE_EVENTS_INTERVAL_S, Connector, ConnectorConfig

    backend_api_key = args.api_key[0] if args.api_key else None
    interval_s = REPORT_CACHE_EVENTS_INTERVAL_S if args.report_cache_events else 0.0
    config = ConnectorConfig(gateway_url=args.connect, token=os.environ.get("TOKIOS_CONNECTOR_TOKEN", ""),
                             backend_url=f"http://127.0.0.1:{port}", backend_id=args.backend_id,
                             backend_api_key=backend_api_key, drain_grace_s=args.shutdown_timeout,
                             cache_events_interval_s=interval_s)
    connector = Connector(config)

    async def run_connector(_state) -> None:
        try:
            await connector.run()
        except Exception as exc:  # the server keeps serving locally; the log says why
            logging.getLogger("tokios.server").error("gateway connector stopped: %s", getattr(exc, "message", exc))

    state.companions.append(run_connector)
    state.on_drain.append(connector.request_drain)
