"""The model layer's name for the shared GGUF parser (the parser lives in tokios/gguf_file.py).

Kept so `tokios.model.gguf_file.GGUFFile` and `TensorInfo` stay importable; model/loader.py
reads hyper-parameters and memory-mapped tensor bytes through them.
"""

from __future__ import annotations

from tokios.gguf_file import DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFFile, TensorInfo

__all__ = ["DEFAULT_ALIGNMENT", "GGUF_MAGIC", "GGUFFile", "TensorInfo"]
