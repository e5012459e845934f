"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with QKV bias) as one forward pass.

The file describes the maths only: weight formats come in through model/linear.py, the paged
KV cache and batch layout through AttentionMetadata (model/attention.py). Q, K and V share one
fused projection, and gate/up share another, so a decode step issues 4 matrix products per layer.
Weights arrive as a dict in Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...),
whatever file they came from.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokios.config import ModelConfig
from tokios.model.attention import AttentionMetadata, paged_attention, write_kv
from tokios.model.linear import make_linear
from tokios.model.rope import RotaryEmbedding

# Weight format -> dtype of activations and of the KV cache.
ACTIVATION_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "int8": torch.float32, "int4": torch.float32}


class LlamaLayer:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, weight_format: str,
                 device: torch.device):
        def weight(name: str) -> torch.Tensor:
            return weights.pop(f"{prefix}.{name}")

        def bias(name: str) -> torch.Tensor | None:
            return weights.pop(f"{prefix}.{name}", None)

        dtype = ACTIVATION_DTYPE[weight_format]
        self.input_norm = weight("input_layernorm.weight").to(device=device, dtype=dtype)
        self.post_attention_norm = weight("post_attention_layernorm.weight").to(device=device, dtype=dtype)
        qkv_weight = torch.cat([weight("self_attn.q_proj.weight"), weight("self_attn.k_proj.weight"),
                                weight("self_attn.v_proj.weight")])
        qkv_biases = [bias(f"self_attn.{n}_proj.bias") for n in "qkv"]
        qkv_bias = torch.cat(qkv_biases) if all(b is not None for b in qkv_biases) else None
        self.qkv = make_linear(qkv_weight, qkv_bias, weight_format, device)
        self.o_proj = make_linear(weight("self_attn.o_proj.weight"), None, weight_format, device)
        gate_up = torch.cat([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")])
        self.gate_up = make_linear(gate_up, None, weight_format, device)
        self.down = make_linear(weight("mlp.down_proj.weight"), None, weight_format, device)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], weight_format: str,
                 device: torch.device):
        self.config = config
        self.weight_format = weight_format
        self.device = device
        self.dtype = ACTIVATION_DTYPE[weight_format]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        embed = weights.pop("model.embed_tokens.weight")
        # The embedding table is only gathered from (a row per token), so it stays dense.
        self.embed_tokens = embed.to(device=device, dtype=self.dtype)
        lm_head = weights.pop("lm_head.weight", None)
        self.lm_head = make_linear(embed if lm_head is None else lm_head, None, weight_format, device)
        self.norm = weights.pop("model.norm.weight").to(device=device, dtype=self.dtype)
        self.layers = [LlamaLayer(config, weights, f"model.layers.{i}", weight_format, device)
                       for i in range(config.num_layers)]
        self.rotary = RotaryEmbedding(config, config.max_model_len, device, torch.float32)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]."""
        config = self.config
        num_tokens = input_ids.shape[0]
        hidden = self.embed_tokens[input_ids]
        cos, sin = self.rotary.tables(positions)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            normed = self._norm(hidden, layer.input_norm)
            qkv = layer.qkv(normed)
            query = qkv[:, :self.q_size].view(num_tokens, config.num_heads, config.head_dim)
            key = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, config.num_kv_heads, config.head_dim)
            value = qkv[:, self.q_size + self.kv_size:].view(num_tokens, config.num_kv_heads, config.head_dim)
            query = self.rotary.apply(query.float(), cos, sin)
            key = self.rotary.apply(key.float(), cos, sin)
            write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
            attended = paged_attention(query, key_cache, value_cache, metadata, self.scale)
            hidden = hidden + layer.o_proj(attended.reshape(num_tokens, self.q_size).to(self.dtype)).to(self.dtype)
            normed = self._norm(hidden, layer.post_attention_norm)
            gate_up = layer.gate_up(normed)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + layer.down(F.silu(gate) * up).to(self.dtype)
        return self._norm(hidden, self.norm)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_sampled, hidden] -> float32 logits [num_sampled, vocab]."""
        return self.lm_head(hidden).float()

    def weight_bytes(self) -> int:
        linears = [self.lm_head] + [lin for layer in self.layers
                                    for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return sum(lin.num_bytes() for lin in linears)
