"""`tokios serve`: the HTTP server (server/cli.py), and with --connect the gateway connector
beside it (gateway/connector_cli.py). Composed here so that the server and the gateway packages
never import each other: the gateway speaks the server's dialects, the server knows no gateway."""

from __future__ import annotations

import argparse

from tokios.gateway import connector_cli
from tokios.server import cli as server_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server_cli.add_arguments(parser)
    connector_cli.add_serve_arguments(parser)


def run(args: argparse.Namespace) -> int:
    connector_cli.check_serve_arguments(args)
    if not args.connect:
        return server_cli.run(args)
    return server_cli.run(args, on_listening=lambda state, port: connector_cli.attach_to_server(state, args, port))
