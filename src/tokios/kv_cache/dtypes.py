"""The KV cache's element formats: their names and what one cached value costs in bytes.
No torch here: `tokios plan` sizes caches with the same arithmetic without loading it.

int8 is symmetric per token and head: a head's head_dim values are stored as round(x / scale)
with scale = absmax / 127, and the scale as float32 right after them, so a slot is
[num_kv_heads, head_dim + 4] bytes (model/attention.py quantize_kv is the reference the C++
kernels match byte for byte). Keeping the scale inside the slot keeps a block one slice of one
tensor: the prefix cache's copy-on-write, the disk tier's spills and loads and the runner's
gathers move scales with their values, with no second tensor to keep in step. It is the same
68 bytes per 64 values as llama.cpp's q8_0 cache, 0.53 of bfloat16.

The engine (engine/core.py: how many blocks fit in --kv-cache-memory), the planner
(tools/plan/) and `bench compare` all size the cache with kv_bytes_per_element and
kv_bytes_per_token.
"""

from __future__ import annotations

INT8_SCALE_BYTES = 4  # float32, after each head's values
# Formats the engine stores (--kv-cache-dtype), then ones only the planner knows (fp8: one
# per-tensor scale, as vLLM's fp8 cache).
ENGINE_KV_DTYPES = ("float32", "bfloat16", "int8")
ELEMENT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "fp8": 1.0}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def canonical_name(name) -> str:
    """A format's name from a planner name (bf16), an engine name (bfloat16) or a torch dtype."""
    text = str(name).removeprefix("torch.")
    return ALIASES.get(text, text)


def kv_bytes_per_element(name, head_dim: int) -> float:
    """Bytes of one cached K (or V) value, its share of the int8 scale included."""
    name = canonical_name(name)
    if name == "int8":
        return 1.0 + INT8_SCALE_BYTES / head_dim
    if name in ELEMENT_BYTES:
        return ELEMENT_BYTES[name]
    raise ValueError(f"unknown KV cache dtype {name!r}")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float) -> float:
    """K and V of one token in every layer: 2 x layers x KV heads x head_dim x bytes per element
    (kv_bytes_per_element's, an int8 head's scale included)."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def slot_width(dtype, head_dim: int) -> int:
    """Elements of one head in one slot of a cache tensor of `dtype`."""
    return head_dim + INT8_SCALE_BYTES if canonical_name(dtype) == "int8" else head_dim
