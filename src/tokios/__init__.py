"""Tokios: serve a language model from your own hardware.

The public entry points are `tokios.engine.LLM` (offline), `tokios.engine.AsyncEngine`
(streaming, used by the server) and the `tokios` command line (`tokios.cli`).
"""

__version__ = "0.1.0"
