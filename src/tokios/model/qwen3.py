"""Qwen3 as one forward pass: the dense models, and Qwen3-MoE (`qwen3moe`), whose layers differ
only in their feed-forward (model/mlp.py builds the sparse MoE from the file's experts).

Where it differs from Llama (model/llama.py): queries and keys get a per-head RMSNorm over
head_dim before RoPE (weights multiply as stored, unlike Gemma's 1 + w), and the attention has
no biases. Its head_dim is the file's own, not hidden / heads; RoPE is NEOX (llama.cpp's
converter leaves Q/K rows unpermuted), and a YaRN scaling is applied by model/rope.py.
"""

from __future__ import annotations

import torch

from tokios.config import ModelConfig
from tokios.model.llama import LlamaLayer, LlamaModel
from tokios.model.quant import as_dense


class Qwen3Layer(LlamaLayer):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, weight_format: str,
                 device: torch.device, ops):
        super().__init__(config, weights, prefix, weight_format, device, ops)
        # Float32 whatever the activations, as Gemma 3's: they feed RoPE and the cache.
        self.q_norm = as_dense(weights.pop(f"{prefix}.self_attn.q_norm.weight")).to(device=device, dtype=torch.float32)
        self.k_norm = as_dense(weights.pop(f"{prefix}.self_attn.k_norm.weight")).to(device=device, dtype=torch.float32)


class Qwen3Model(LlamaModel):
    layer_class = Qwen3Layer

    def project_qkv(self, layer: Qwen3Layer, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.normalize_heads(super().project_qkv(layer, hidden).float(), layer.q_norm, layer.k_norm)
