"""What Phi-3 (the `phi3` architecture: Phi-3, Phi-3.5, Phi-4-mini) changes in Llama's model:
only how its file stores the weights. It runs as model/llama.py's LlamaModel.

The checkpoint fuses the projections, q, k and v in one `qkv_proj` and gate and up in one
`gate_up_proj` (gate first), and llama.cpp's converter keeps them so (`attn_qkv`, and `ffn_up`
with twice the rows; model/loader.py names them back), in rotate-half order (no Q/K permutation).
They are split here into Llama's q/k/v and gate/up weights, so that everything keyed by those
names (the layer's own fusing, tensor-parallel sharding) serves Phi-3 unchanged. LongRoPE, which
the long-context models declare, and Phi-4-mini's partial rotary are model/rope.py's, read from
the file like any other RoPE setting.

A `sliding_window` in the config (Phi-3-mini-4k's 2047) is not applied, as llama.cpp does not
apply it to phi3 files (its converter writes the key, its runtime turns it off); transformers
does, so the two differ on sequences longer than the window.
"""

from __future__ import annotations

from tokios.config import ModelConfig
from tokios.errors import ModelLoadError
from tokios.model.quant import select_rows


def split_fused_projections(weights: dict, config: ModelConfig) -> dict:
    """`weights` (Hugging Face names) with every layer's qkv_proj and gate_up_proj replaced by
    the separate projections they stack; packed weights stay packed (whole rows move)."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    fused_rows = {"qkv_proj.weight": q_size + 2 * kv_size, "gate_up_proj.weight": 2 * config.intermediate_size}
    split = {}
    for name, weight in weights.items():
        expected_rows = fused_rows.get(name.rsplit(".", 1)[0].rsplit(".", 1)[-1] + ".weight")
        if expected_rows is not None and weight.shape[0] != expected_rows:
            raise ModelLoadError(f"{name} has {weight.shape[0]} rows; the config's heads and widths make "
                                 f"{expected_rows}")
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name[:-len("qkv_proj.weight")]
            split[f"{prefix}q_proj.weight"] = select_rows(weight, slice(0, q_size))
            split[f"{prefix}k_proj.weight"] = select_rows(weight, slice(q_size, q_size + kv_size))
            split[f"{prefix}v_proj.weight"] = select_rows(weight, slice(q_size + kv_size, q_size + 2 * kv_size))
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name[:-len("gate_up_proj.weight")]
            split[f"{prefix}gate_proj.weight"] = select_rows(weight, slice(0, config.intermediate_size))
            split[f"{prefix}up_proj.weight"] = select_rows(weight, slice(config.intermediate_size,
                                                                         2 * config.intermediate_size))
        else:
            split[name] = weight
    return split
