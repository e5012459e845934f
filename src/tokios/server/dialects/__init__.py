"""The API dialects the server speaks, one record each (dialects/dialect.py): OpenAI's chat,
completions and embeddings (dialects/openai), OpenAI Responses, Anthropic Messages, Ollama, and
the Cohere / Jina rerank API.
Each translates its bodies onto the shared chat path (server/generation.py) and shapes the answers,
errors and streams its clients expect. The app installs their routes, /openapi.json documents
them, errors.py and the gateway find a path's error and stream shape with `dialect_of_path`."""

from __future__ import annotations

from tokios.server.dialects.anthropic import ANTHROPIC
from tokios.server.dialects.dialect import Dialect, Route
from tokios.server.dialects.ollama import OLLAMA
from tokios.server.dialects.openai import OPENAI
from tokios.server.dialects.openai_responses import RESPONSES
from tokios.server.dialects.rerank import RERANK_API

DIALECTS: tuple[Dialect, ...] = (OPENAI, RESPONSES, ANTHROPIC, OLLAMA, RERANK_API)


def dialect_of_path(path: str) -> Dialect:
    """Which API answers at `path` (OpenAI's for every path no dialect claims)."""
    for dialect in DIALECTS:
        if dialect.owns(path):
            return dialect
    return OPENAI


__all__ = ["ANTHROPIC", "DIALECTS", "OLLAMA", "OPENAI", "RERANK_API", "RESPONSES", "Dialect", "Route", "dialect_of_path"]
