"""The torch element types a weight format runs with: its activations' and its KV cache's.

Owned here, beside the layers that compute in them, and read by every architecture (llama.py,
gemma3.py), the draft model, the engine (which allocates the cache) and the roofline tool.
kv_cache/dtypes.py keeps the torch-free side of the cache's formats (names and byte counts).
"""

from __future__ import annotations

import torch

# Weight format -> dtype of activations.
ACTIVATION_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "int8": torch.float32, "int4": torch.float32, "stored": torch.float32}


def kv_cache_dtype(weight_format: str, requested: str = "auto") -> torch.dtype:
    """The KV cache's element type. auto: float32 only for float32 weights (the exact reference);
    bfloat16 otherwise, which halves the cache (the quantized formats keep float32 activations,
    and the C++ attention widens bf16 keys and values exactly on load). Measured on the default
    model in int4: perplexity 29.640 with a float32 cache, 29.622 with bfloat16 (transformers
    float32: 29.655). int8 is asked for, never automatic (kv_cache/dtypes.py)."""
    if requested != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[requested]
    return torch.float32 if weight_format == "float32" else torch.bfloat16
