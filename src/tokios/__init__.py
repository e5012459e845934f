"""Tokios: serve a language model from your own hardware.

The public entry points are `tokios.LLM` (offline; defined in tokios.engine), `tokios.SamplingParams`
(tokios.sampling_params), `tokios.engine.AsyncEngine` (streaming, used by the server) and the
`tokios` command line (`tokios.cli`).

`from tokios import LLM, SamplingParams` imports the engine on first use (PEP 562 module
`__getattr__`), not at `import tokios`: the server's front end, the gateway and `tokios plan` import
tokios.* submodules and must not pay for torch and the model code they never run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokios.engine import LLM
    from tokios.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

_NAME_TO_MODULE = {"LLM": "tokios.engine", "SamplingParams": "tokios.sampling_params"}


def __getattr__(name: str) -> Any:
    module_name = _NAME_TO_MODULE.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tokios' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAME_TO_MODULE})
