"""Logprobs as every dialect reports them: alternatives ranked best first (by the engine's rank,
else by value) and values clamped to a finite floor, since JSON has no -Infinity.
The OpenAI shapes (dialects/openai/shapes.py) and Ollama's lines read them from here."""

from __future__ import annotations

import math
from collections.abc import Callable

from tokios.outputs import Logprob, TokenLogprobs

# JSON has no -Infinity; OpenAI-compatible servers clamp to this floor.
MIN_LOGPROB = -9999.0

# token id -> the token's text, for logprobs (decoded_token when the engine supplied it).
TokenDecoder = Callable[[int, Logprob | None], str]


def finite_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) or value < MIN_LOGPROB else float(value)


def ranked(position: TokenLogprobs) -> list[tuple[int, Logprob]]:
    """Entries best first: by rank where the engine gave one, else by logprob."""
    return sorted(position.items(), key=lambda item: (
        item[1].rank if item[1].rank is not None else math.inf, -item[1].logprob))


def top_ranked(position: TokenLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    entries = ranked(position)
    # The sampled token is added to the dict even when it is outside the top k; keep only the top k.
    return entries[:num_top]


