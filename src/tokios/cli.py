"""The `tokios` command line: one sub-command per module.

Each sub-command lives in its own module exposing `add_arguments(parser)` and `run(args)`;
this file only wires names to modules, imported lazily so that `tokios plan` does not pay
for importing torch and `tokios --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tokios.commands.generate", "generate text for one prompt, streamed to the terminal"),
    "chat": ("tokios.commands.chat", "interactive multi-turn chat in the terminal"),
    "tokenize": ("tokios.commands.tokenize", "print token ids and pieces for a text"),
    "serve": ("tokios.commands.serve", "start the OpenAI-compatible HTTP server"),
    "bench": ("tokios.tools.bench.cli", "benchmarks: offline engine vs peers, serving load"),
    "plan": ("tokios.tools.plan.cli", "capacity planning by formula"),
    "roofline": ("tokios.tools.roofline.cli", "measured utilization against the machine's roofs"),
    "simulate": ("tokios.tools.simulate.cli", "discrete-event simulation of a fleet: routing policies, SLO fleet size"),
    "soak": ("tokios.tools.soak", "thousands of mixed requests against a server, then leak checks"),
    "worker": ("tokios.distributed.cli", "run this machine's ranks of a server's tensor/pipeline parallel group"),
    "gateway": ("tokios.gateway.cli", "run the gateway (stable authenticated endpoint)"),
    "connect": ("tokios.gateway.connector_cli", "connect a local backend to a gateway"),
    "keys": ("tokios.gateway.keys_cli", "manage gateway API keys and connector tokens"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokios", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    requested = argv[0] if argv and not argv[0].startswith("-") else None
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        # Only the requested command's module is imported (and so only its dependencies).
        if name == requested:
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from tokios.errors import TokiosError

    try:
        return int(args._run(args) or 0)
    except TokiosError as exc:
        # User-facing failures are one line, never a traceback from deep inside.
        print(f"tokios {args.command}: error: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
