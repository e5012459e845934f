"""What a Gemma 3 GGUF says beyond the Llama shape: per-layer sliding windows, the local RoPE
base, the attention scale, softcapping. No torch here: read by model/shape.py, the one
description of a model file.
"""

from __future__ import annotations

from typing import Any

from tokios.errors import ModelLoadError, UnsupportedError

# Every sixth layer attends globally (llama.cpp's fixed pattern when the file has none).
SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_BASE = 10000.0


def gemma3_fields(metadata: dict[str, Any], path: str, num_layers: int) -> dict[str, Any]:
    """What Gemma 3 adds to the Llama shape: sliding windows, the local RoPE base, the attention
    scale, softcapping. A variant this code does not implement is an error naming the key."""
    arch = "gemma3"
    if metadata.get(f"{arch}.attn_logit_softcapping") is not None:
        raise UnsupportedError(f"{path}: {arch}.attn_logit_softcapping is set; attention-logit softcapping "
                               "is not implemented (Gemma 3 files do not use it)")
    key_length = metadata.get(f"{arch}.attention.key_length")
    value_length = metadata.get(f"{arch}.attention.value_length", key_length)
    if key_length != value_length:
        raise UnsupportedError(f"{path}: key_length {key_length} != value_length {value_length} is not supported")
    return {**sliding_fields(metadata, arch, path, num_layers),
            # Gemma 3's query_pre_attn_scalar is head_dim for every size the converter writes.
            "query_pre_attn_scalar": float(metadata.get(f"{arch}.attention.key_length"))}


def sliding_fields(metadata: dict[str, Any], arch: str, path: str, num_layers: int) -> dict[str, Any]:
    """Per-layer sliding windows, the sliding layers' RoPE base and the final softcap, under the
    GGUF keys of `arch` (Gemma 3 and what builds on it)."""
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    return {"layer_windows": sliding_layer_windows(metadata, arch, path, num_layers, SLIDING_WINDOW_PATTERN),
            "rope_local_theta": float(metadata.get(f"{arch}.rope.freq_base_swa", LOCAL_ROPE_BASE)),
            "final_logit_softcapping": None if softcap is None else float(softcap)}


def sliding_layer_windows(metadata: dict[str, Any], arch: str, path: str, num_layers: int,
                          default_pattern: int) -> tuple[int | None, ...]:
    """Per layer: the sliding window, or None for full attention. The file's pattern is one flag
    per layer (true: sliding) or a period n (every n-th layer full, the others sliding);
    default_pattern: llama.cpp's period for `arch` when the file has none."""
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.attention.sliding_window")
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):  # one flag per layer: true = sliding
        if len(pattern) != num_layers:
            raise ModelLoadError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                 f"for {num_layers} layers")
        is_sliding = [bool(flag) for flag in pattern]
    else:
        is_sliding = [(i + 1) % int(pattern) != 0 for i in range(num_layers)]
    return tuple(int(window) if sliding else None for sliding in is_sliding)
