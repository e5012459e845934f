"""Fixtures shared by the real-model tests: the transformers reference and a float32 engine on
the default GGUF, each loaded once per test session (transformers takes about 20 s, the
engine a few seconds), so that every module compares against the same two objects.
all-MiniLM-L6-v2's fixtures are in tests/conftest.py (the server tests serve it too)."""

from __future__ import annotations

import pytest

from reference import load_reference_model


@pytest.fixture(scope="session")
def reference_model():
    return load_reference_model()


@pytest.fixture(scope="session")
def engine_float32():
    """The engine in its reference mode. Tests that need another configuration build their own."""
    from tokios.engine import LLM

    return LLM(dtype="float32", kv_cache_memory="128MiB")
