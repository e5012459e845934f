"""The OpenAI dialect: chat completions, completions, embeddings and the OpenAI-compatible
utilities. protocol.py validates the bodies, shapes.py shapes the answers, endpoints.py runs them
and ends with the `OPENAI` record."""

from tokios.server.dialects.openai.endpoints import OPENAI

__all__ = ["OPENAI"]
