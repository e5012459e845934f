"""Tokenizer package: text <-> token ids, chat templates, streaming detokenization, stop strings.

Public names: Tokenizer and load_tokenizer (tokenizer.py), IncrementalDetokenizer (detokenizer.py),
StopStringMatcher (stop.py). A GGUF file's metadata is read by the shared parser (tokios/gguf_file.py).
Text lives only in the front end (engine output processor, server); the engine core sees token ids.
"""

from tokios.tokenizer.detokenizer import IncrementalDetokenizer
from tokios.tokenizer.stop import StopStringMatcher
from tokios.tokenizer.tokenizer import Tokenizer, load_tokenizer, tokenizer_for_loaded_model

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "Tokenizer", "load_tokenizer", "tokenizer_for_loaded_model"]
