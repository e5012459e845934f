"""The tokenizer's name for the shared GGUF metadata reader (the parser lives in tokios/gguf_file.py).

Kept so `tokios.tokenizer.gguf_metadata.read_gguf_metadata` and `GGUF_MAGIC` stay importable;
tokenizer.py reads the vocabulary, merges and chat template through it.
"""

from __future__ import annotations

from tokios.gguf_file import GGUF_MAGIC, SUPPORTED_VERSIONS, read_gguf_metadata

__all__ = ["GGUF_MAGIC", "SUPPORTED_VERSIONS", "read_gguf_metadata"]
