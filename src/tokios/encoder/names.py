"""Checkpoint tensor names -> llama.cpp's GGUF names, the one rule every encoder architecture's
renaming follows: a model-wide tensor by its table, a layer's tensor `<prefix>N.<rest>` by the
layer table, anything else refused by name."""

from __future__ import annotations

import re
from collections.abc import Mapping

from tokios.errors import UnsupportedError


def gguf_tensor_name(name: str, top_names: Mapping[str, str], layer_prefix: str, layer_names: Mapping[str, str],
                     architecture: str) -> str:
    if name in top_names:
        return top_names[name]
    match = re.fullmatch(rf"{re.escape(layer_prefix)}(\d+)\.(.+)", name)
    if match and match.group(2) in layer_names:
        return f"blk.{match.group(1)}.{layer_names[match.group(2)]}"
    raise UnsupportedError(f"tensor {name} is not part of {architecture} as tokios implements it")
