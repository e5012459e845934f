"""What a Gemma 4 GGUF (gemma4_fields) or Hugging Face config.json (gemma4_hf_fields) says
beyond Gemma 3's (model/gemma3_metadata.py): the full-attention layers' wider heads and their
own KV head count, the last layers reading earlier layers' K/V, and attention without a query
scale. No torch here: read by model/shape.py.

The Mixture-of-Experts variant (an expert feed-forward beside the dense one) is refused here,
naming what is missing.
"""

from __future__ import annotations

from typing import Any

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.model.gemma3_metadata import sliding_fields

def gemma4_fields(metadata: dict[str, Any], path: str, num_layers: int) -> dict[str, Any]:
    arch = "gemma4"

    def get(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    fields = sliding_fields(metadata, arch, path, num_layers)
    is_sliding = [window is not None for window in fields["layer_windows"]]
    head_dim, head_dim_swa = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    if (int(get("attention.value_length")), int(get("attention.value_length_swa"))) != (head_dim, head_dim_swa):
        raise UnsupportedError(f"{path}: {arch} value lengths differ from key lengths; not supported")
    # The converter writes proportional RoPE as full rotation of the wide heads with a rope_freqs
    # table that leaves the tail unrotated; the sliding layers rotate their whole head.
    rotary_dims = (int(get("rope.dimension_count")), int(get("rope.dimension_count_swa")))
    if rotary_dims != (head_dim, head_dim_swa):
        raise UnsupportedError(f"{path}: {arch}.rope.dimension_count(_swa) {rotary_dims} != head sizes "
                               f"{(head_dim, head_dim_swa)}: partial rotation is not supported")
    num_kv_heads = get("attention.head_count_kv")
    if not isinstance(num_kv_heads, (list, tuple)):
        num_kv_heads = [num_kv_heads] * num_layers
    layer_kv_shapes = tuple((int(num_kv_heads[layer]), head_dim_swa if is_sliding[layer] else head_dim)
                            for layer in range(num_layers))
    return {**fields,
            "head_dim": head_dim,
            "num_kv_heads": max(heads for heads, _ in layer_kv_shapes),
            "layer_kv_shapes": layer_kv_shapes,
            "kv_source_layers": kv_source_layers(is_sliding, int(metadata.get(f"{arch}.attention.shared_kv_layers", 0)),
                                                 path),
            # the MoE variant keeps its dense MLP beside the experts
            "has_mlp_beside_experts": bool(metadata.get(f"{arch}.expert_count")),
            "query_pre_attn_scalar": 1.0}  # Gemma 4 attends with scale 1 (its q/k norms set the size)


def kv_source_layers(is_sliding: list[bool], num_shared: int, path: str) -> tuple[int, ...] | None:
    """The last num_shared layers read the K/V of the last earlier layer of their own kind
    (sliding or full), as transformers' Gemma 4 and llama.cpp do."""
    if num_shared == 0:
        return None
    first_shared = len(is_sliding) - num_shared
    sources = list(range(len(is_sliding)))
    for layer in range(first_shared, len(is_sliding)):
        earlier = [source for source in range(first_shared) if is_sliding[source] == is_sliding[layer]]
        if not earlier:
            raise ModelLoadError(f"{path}: layer {layer} shares K/V, but no earlier layer of its kind stores any")
        sources[layer] = earlier[-1]
    return tuple(sources)


def gemma4_hf_fields(hf: dict[str, Any], path: str) -> dict[str, Any]:
    """The same from a Gemma4TextConfig's config.json (per_layer_config, or transformers' older
    global_head_dim / num_global_key_value_heads; rope_parameters per layer type)."""
    if hf.get("use_bidirectional_attention") == "all":
        raise UnsupportedError(f"{path}: use_bidirectional_attention 'all' is not supported (causal decoding only)")
    num_layers = int(hf["num_hidden_layers"])
    is_sliding = [kind == "sliding_attention" for kind in hf["layer_types"]]
    head_dim, num_kv_heads = int(hf["head_dim"]), int(hf["num_key_value_heads"])
    global_head_dim = int(hf.get("global_head_dim", head_dim))
    global_kv_heads = int(hf.get("num_global_key_value_heads") or num_kv_heads) if hf.get("attention_k_eq_v") \
        else num_kv_heads
    overrides = {int(layer): values for layer, values in (hf.get("per_layer_config") or {}).items()}
    layer_kv_shapes = []
    for layer in range(num_layers):
        default = (num_kv_heads, head_dim) if is_sliding[layer] else (global_kv_heads, global_head_dim)
        override = overrides.get(layer, {})
        layer_kv_shapes.append((int(override.get("num_key_value_heads", default[0])),
                                int(override.get("head_dim", default[1]))))
    rope = hf.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention", {}), rope.get("sliding_attention", {})
    if sliding.get("rope_type", "default") != "default" or full.get("rope_type", "default") not in ("default",
                                                                                                  "proportional"):
        raise UnsupportedError(f"{path}: RoPE types {sliding.get('rope_type')!r} (sliding) and "
                               f"{full.get('rope_type')!r} (full) are not supported (sliding: default; full: "
                               "default or proportional)")
    full_head_dims = {shape[1] for shape, sliding_layer in zip(layer_kv_shapes, is_sliding) if not sliding_layer}
    softcap = hf.get("final_logit_softcapping")
    return {"layer_windows": tuple(int(hf["sliding_window"]) if flag else None for flag in is_sliding),
            "head_dim": max(full_head_dims or {head_dim}),
            "num_kv_heads": max(heads for heads, _ in layer_kv_shapes),
            "layer_kv_shapes": tuple(layer_kv_shapes),
            "kv_source_layers": kv_source_layers(is_sliding, int(hf.get("num_kv_shared_layers") or 0), path),
            "has_mlp_beside_experts": bool(hf.get("enable_moe_block")),
            "rope_theta": float(full.get("rope_theta", 1_000_000.0)),
            "rope_scaling": ({"type": "proportional", "partial_rotary_factor": float(full["partial_rotary_factor"])}
                             if full.get("rope_type") == "proportional" else None),
            "rope_local_theta": float(sliding.get("rope_theta", 10_000.0)),
            "query_pre_attn_scalar": 1.0,
            "final_logit_softcapping": None if softcap is None else float(softcap)}
