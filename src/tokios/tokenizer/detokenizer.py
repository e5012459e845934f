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
  boundary window) are decoded, so the work per token is bounded by the window, not the
  sequence length; trailing <0xNN> tokens that form an unfinished character are held back.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from tokios.tokenizer.tokenizer import Tokenizer

# A UTF-8 character spans at most 4 bytes, so at most 3 trailing byte tokens can be unfinished.
MAX_INCOMPLETE_BYTES = 3


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
        # Skipped tokens are dropped here rather than by the backend, which would also drop the
        # special tokens the tokenizer shows (reasoning markers).
        self._skipped_ids = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        self._num_tokens = tokenizer.vocab_size
        self._byte_token_to_byte = tokenizer.byte_fallback_token_to_byte
        # ids[:read_offset] are emitted; ids[prefix_offset:read_offset] is the boundary window,
        # re-decoded for context (a decoder strips the first leading space of what it decodes).
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def _num_unfinished_tokens(self) -> int:
        """How many trailing byte-fallback tokens form a UTF-8 character that is not complete yet."""
        tail = bytearray()
        for token_id in reversed(self._ids[-MAX_INCOMPLETE_BYTES:]):
            byte = self._byte_token_to_byte.get(token_id)
            if byte is None:
                break
            tail.insert(0, byte)
        if not tail:
            return 0
        # With final=False the UTF-8 codec leaves exactly an unfinished (but so far valid) tail unconsumed.
        _, num_consumed = codecs.utf_8_decode(bytes(tail), "replace", False)
        return len(tail) - num_consumed

    def _emit_until(self, end: int) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset : end])
        if len(text) <= len(prefix_text):
            # Nothing visible yet (e.g. a skipped special token): keep the window, so the next
            # token is still decoded after real text and keeps its leading space.
            return ""
        # Drop what is settled; the tokens just emitted become the next boundary window.
        del self._ids[: self._read_offset]
        self._read_offset, self._prefix_offset = end - self._read_offset, 0
        return text[len(prefix_text) :]

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(i for i in token_ids if 0 <= i < self._num_tokens and i not in self._skipped_ids)
        end = len(self._ids) - self._num_unfinished_tokens()
        return self._emit_until(end) if end > self._read_offset else ""

    def flush(self) -> str:
        return self._emit_until(len(self._ids))


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
