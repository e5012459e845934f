"""The GPT-2 byte-level alphabet: each byte is spelled as one printable character.

Owns the byte <-> character maps and the per-token byte table that the incremental detokenizer
uses. Talks to nobody; used by tokenizer.py (to spell vocabularies) and detokenizer.py.

Byte-level BPE vocabularies never contain raw bytes: printable Latin-1 bytes stand for
themselves and the others (space, control bytes, 0x7F-0xA0, 0xAD) are shifted to U+0100 and up,
which is why a leading space shows as "Ġ" and a newline as "Ċ".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
import re
from functools import lru_cache


@lru_cache(maxsize=1)
def byte_to_char() -> dict[int, str]:
    """byte value -> the character that spells it in a byte-level vocabulary."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {byte: chr(byte) for byte in printable}
    num_shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + num_shifted)
            num_shifted += 1
    return mapping


@lru_cache(maxsize=1)
def char_to_byte() -> dict[str, int]:
    return {char: byte for byte, char in byte_to_char().items()}


def is_byte_level_spelling(token: str) -> bool:
    """True when every character of `token` is in the byte alphabet."""
    return _outside_alphabet().search(token) is None


def spell_bytes(text: str) -> str:
    """Spell `text`'s UTF-8 bytes in the byte alphabet ("a b" -> "aĠb")."""
    mapping = byte_to_char()
    return "".join(mapping[byte] for byte in text.encode("utf-8"))


@lru_cache(maxsize=1)
def _char_to_latin1_table() -> dict[int, int]:
    """str.translate table: alphabet character -> the Latin-1 character of its byte."""
    return {ord(char): byte for char, byte in char_to_byte().items()}


@lru_cache(maxsize=1)
def _outside_alphabet() -> re.Pattern[str]:
    return re.compile("[^" + re.escape("".join(char_to_byte())) + "]")


def token_to_bytes(token: str) -> bytes:
    """The bytes a byte-level decoder produces for one token.

    Mirrors the `tokenizers` ByteLevel decoder: a token spelled entirely in the byte alphabet maps
    back char by char; any other token (an added token with a character outside the alphabet)
    contributes its own UTF-8 bytes.
    """
    if _outside_alphabet().search(token):
        return token.encode("utf-8")
    # translate + latin-1 runs in C: about 40x faster than a per-character Python loop.
    return token.translate(_char_to_latin1_table()).encode("latin-1")


def build_token_bytes_table(
    id_to_token: Sequence[str | None], skipped_ids: Iterable[int] = ()
) -> tuple[bytes, ...]:
    """token id -> decoded bytes; ids with no token, or in `skipped_ids`, decode to b""."""
    table = [b"" if token is None else token_to_bytes(token) for token in id_to_token]
    for token_id in skipped_ids:
        if 0 <= token_id < len(table):
            table[token_id] = b""
    return tuple(table)
