"""OLMoE (the `olmoe` architecture) as one forward pass: Llama's layer with a mixture of experts
(model/mlp.py builds it from the file's experts) and one change in attention.

Its query and key norms are RMSNorms over the whole projection, q [heads * head_dim] and k
[kv_heads * head_dim] each as one vector, not per head as Qwen3's: transformers' OlmoeAttention
and llama.cpp's olmoe graph (attn_q_norm and attn_k_norm of n_embd) both norm before splitting
into heads. Weights multiply as stored; RoPE is NEOX (the converter leaves Q/K rows unpermuted).
"""

from __future__ import annotations

import torch

from tokios.model.llama import LlamaModel
from tokios.model.qwen3 import Qwen3Layer


class OlmoeModel(LlamaModel):
    # Qwen3's layer: the same weights (q_norm and k_norm, float32), only wider
    layer_class = Qwen3Layer

    def project_qkv(self, layer: Qwen3Layer, hidden: torch.Tensor) -> torch.Tensor:
        qkv = super().project_qkv(layer, hidden).float()
        q_size, kv_size = self.ops.q_size, self.ops.kv_size
        query = self.ops.rms_norm(qkv[:, :q_size].contiguous(), layer.q_norm)
        key = self.ops.rms_norm(qkv[:, q_size:q_size + kv_size].contiguous(), layer.k_norm)
        return torch.cat([query, key, qkv[:, q_size + kv_size:]], dim=1)
