"""The API dialects beside OpenAI's chat and completions: Ollama, Anthropic Messages and OpenAI
Responses. Each module translates its bodies onto the shared chat path (server/generation.py)
and shapes the answers and errors its clients expect; `DIALECT_ROUTES` installs them all on the
app (server/app.py), and `DIALECT_OPENAPI_ROUTES` describes them for /openapi.json."""

from __future__ import annotations

from tokios.server.dialects import anthropic, ollama, openai_responses


def _install_responses(app, state) -> None:
    store = openai_responses.ResponseStore(state.settings.responses_store_size, state.settings.responses_store_ttl_s)
    openai_responses.install(app, state, store)


DIALECT_ROUTES = [ollama.install, anthropic.install, _install_responses]

# path -> (method, summary, request body model or None, streamed media type or None)
DIALECT_OPENAPI_ROUTES = {**ollama.OLLAMA_ROUTES, **anthropic.ANTHROPIC_ROUTES, **openai_responses.RESPONSES_ROUTES}
