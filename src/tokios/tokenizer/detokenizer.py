"""Streaming detokenization: token ids in, UTF-8-safe text deltas out.

Owns IncrementalDetokenizer, used by the engine's output processor (one per request sequence);
it reads the Tokenizer only. Concatenating every delta plus flush() gives exactly
`tokenizer.decode(all_ids, skip_special_tokens=...)`, and no delta ever ends in half a character.

Two strategies, picked once at construction (never per token):
- Byte-level vocabularies (GPT-2 style, the default model): each token id maps to a fixed byte
  string, so decoding is "append bytes, emit the complete UTF-8 prefix". A C incremental UTF-8
  decoder does exactly that, holding at most 3 bytes of an unfinished character and replacing
  invalid bytes the way a one-shot lossy decode does. O(1) work per token.
- Anything else (SentencePiece-style byte fallback <0xNN>, "▁" space markers, Strip decoders):
  vLLM-style windowed decode. Only the tokens since the last emitted boundary (plus one
  boundary window) are decoded, and text that ends in U+FFFD is held until it settles, so the
  work per token is bounded by the window, not the sequence length.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokios.tokenizer.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"

# A UTF-8 character spans at most 4 byte-fallback tokens; text still ending in U+FFFD after this
# many held tokens is genuinely invalid and is released rather than held forever.
MAX_HELD_TOKENS = 6


class _ByteLevelStream:
    def __init__(self, token_bytes: tuple[bytes, ...]):
        self._token_bytes = token_bytes
        self._num_tokens = len(token_bytes)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        token_bytes, num_tokens = self._token_bytes, self._num_tokens
        # Ids past the vocabulary (a model with padded embeddings) decode to nothing, as in decode().
        data = b"".join(token_bytes[i] if 0 <= i < num_tokens else b"" for i in token_ids)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _WindowedStream:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool):
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._num_tokens = tokenizer.vocab_size
        # ids[:read_offset] are emitted; ids[prefix_offset:read_offset] is the boundary window
        # re-decoded for context (leading-space stripping and byte merging look one window back).
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _new_text(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decode(window[: self._read_offset - self._prefix_offset])
        return prefix_text, self._decode(window)

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(i for i in token_ids if 0 <= i < self._num_tokens)
        prefix_text, new_text = self._new_text()
        num_held_tokens = len(self._ids) - self._read_offset
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(REPLACEMENT_CHAR) and num_held_tokens < MAX_HELD_TOKENS:
            return ""
        delta = new_text[len(prefix_text) :]
        # Keep only the new boundary window, so memory and work stay bounded per request.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        prefix_text, new_text = self._new_text()
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class IncrementalDetokenizer:
    """Turns a growing sequence of token ids into text deltas that are safe to show.

    add_tokens(ids) returns the text that became final with these ids (possibly ""); flush()
    returns whatever is still held (an unfinished character decodes as decode() would).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        token_bytes = tokenizer.token_bytes_table(skip_special_tokens)
        self._stream: _ByteLevelStream | _WindowedStream = (
            _ByteLevelStream(token_bytes)
            if token_bytes is not None
            else _WindowedStream(tokenizer, skip_special_tokens)
        )
        self.num_tokens = 0

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self.num_tokens += len(token_ids)
        return self._stream.add_tokens(token_ids)

    def flush(self) -> str:
        return self._stream.flush()
