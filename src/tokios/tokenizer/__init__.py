"""Tokenizer package: text <-> token ids, chat templates, streaming detokenization, stop strings.

Public names: Tokenizer and load_tokenizer (tokenizer.py), read_gguf_metadata (gguf_metadata.py),
IncrementalDetokenizer (detokenizer.py), StopStringMatcher (stop.py). Text lives only in the front
end (engine output processor, server); the engine core sees token ids.
"""

from tokios.tokenizer.detokenizer import IncrementalDetokenizer
from tokios.tokenizer.gguf_metadata import read_gguf_metadata
from tokios.tokenizer.stop import StopStringMatcher
from tokios.tokenizer.tokenizer import Tokenizer, load_tokenizer, tokenizer_for_loaded_model

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "Tokenizer", "load_tokenizer", "read_gguf_metadata",
           "tokenizer_for_loaded_model"]
