"""Command-line tools beside the server, one package per tool: bench/ (`tokios bench`), plan/
(`tokios plan`), roofline/ (`tokios roofline`), and soak.py (`tokios soak`, one file).

Each tool's cli module exposes `add_arguments(parser)` and `run(args) -> int`; tokios/cli.py
imports it only when its command runs. Nothing here is imported by the engine.
"""
