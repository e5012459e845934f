"""Benchmark prompts of a chosen token length, each starting differently.

Prompts are random English words from a seeded generator, so that every run of a benchmark sends
the same text, and no two prompts share a start (a server's prefix/prompt cache cannot turn a
prefill measurement into a cache lookup). With a tokenizer (anything with encode/decode) the
text is cut to the exact token count; without one, one word is counted as one token, which is
close for this vocabulary with byte-level BPE. Used by serve.py, offline.py and prefix.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from tokios.errors import InvalidRequestError

# Common words that byte-level BPE vocabularies hold as single tokens (with the leading space).
_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education river garden music "
    "light road market energy paper science window summer winter table letter bread field forest "
    "stone voice color animal island bridge train ocean mountain village doctor picture language"
).split()


class TokenCodec(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class LengthSpec:
    """A token length: fixed (low == high) or drawn uniformly from low..high inclusive."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, *, field_name: str) -> "LengthSpec":
        """'128' -> fixed 128; '64:256' -> uniform in 64..256."""
        parts = str(text).split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (1, 2) or min(values) < 1 or values[0] > values[-1]:
            raise InvalidRequestError(
                f"{field_name} must be N or LOW:HIGH with 1 <= LOW <= HIGH, got {text!r}",
                param=field_name)
        return cls(values[0], values[-1])

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def random_words(num_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def make_prompt(num_tokens: int, rng: random.Random, codec: TokenCodec | None = None) -> str:
    """A prompt of num_tokens tokens (exact with a codec, approximate without)."""
    if codec is None:
        return random_words(num_tokens, rng)
    # Over-generate, then cut at the token level; re-encoding the decoded cut can merge across
    # the cut, so trim word by word until the count is exact or just under.
    text = random_words(num_tokens + 8, rng)
    token_ids = codec.encode(text)[:num_tokens]
    text = codec.decode(token_ids)
    while len(codec.encode(text)) > num_tokens:
        text = text[: text.rfind(" ")] if " " in text else text[:-1]
    return text


def make_token_ids(num_tokens: int, rng: random.Random, codec: TokenCodec) -> list[int]:
    """Exactly num_tokens token ids of natural text (for engines that take ids directly)."""
    return codec.encode(random_words(num_tokens + 8, rng))[:num_tokens]
