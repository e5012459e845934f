"""Gemma 3 as one forward pass (the text model; what a Gemma 3 GGUF holds).

Where it differs from Llama (model/llama.py), all read from the file by the loader: the
embedding is scaled by sqrt(hidden); RMSNorm weights are stored as (1 + w) by llama.cpp's
converter, so they multiply as stored; queries and keys get a per-head RMSNorm before RoPE;
each layer has four norms (before and after attention, before and after the feed-forward);
the feed-forward is GeGLU with tanh GELU; RoPE is NEOX (the converter leaves Q/K unpermuted)
with base 10,000 on sliding layers and the file's base on global ones; sliding layers attend
to the last `window` positions only (the runner hands them their KV group's metadata,
kv_cache/layout.py); the output head is the tied embedding; an optional final softcap.
Linear layers, norms and the paged attention are the same ops as Llama's (model/ops.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tokios.config import ModelConfig
from tokios.model.attention import AttentionMetadata
from tokios.model.kernels import precise_activations
from tokios.model.linear import make_linear
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.decoder import DecoderModel, ModelPart
from tokios.model.quant import EmbeddingTable, as_dense, concat_rows
from tokios.model.rope import RotaryEmbedding


class Gemma3Layer:
    def __init__(self, config: ModelConfig, weights: dict, prefix: str, weight_format: str, device: torch.device,
                 rotary: RotaryEmbedding):
        def weight(name: str):
            return weights.pop(f"{prefix}.{name}")

        dtype = ACTIVATION_DTYPE[weight_format]
        precise = precise_activations(weight_format)

        def norm(name: str) -> torch.Tensor:
            return as_dense(weight(name)).to(device=device, dtype=dtype)

        self.input_norm = norm("input_layernorm.weight")
        self.post_attention_norm = norm("post_attention_layernorm.weight")
        self.pre_feedforward_norm = norm("pre_feedforward_layernorm.weight")
        self.post_feedforward_norm = norm("post_feedforward_layernorm.weight")
        # Per-head norms run in float32 whatever the activations: they feed RoPE and the cache.
        self.q_norm = as_dense(weight("self_attn.q_norm.weight")).to(device=device, dtype=torch.float32)
        self.k_norm = as_dense(weight("self_attn.k_norm.weight")).to(device=device, dtype=torch.float32)
        qkv = concat_rows([weight("self_attn.q_proj.weight"), weight("self_attn.k_proj.weight"),
                           weight("self_attn.v_proj.weight")])
        self.qkv = make_linear(qkv, None, weight_format, device, precise)
        self.o_proj = make_linear(weight("self_attn.o_proj.weight"), None, weight_format, device, precise,
                                  exact_sums=True)
        gate_up = concat_rows([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")])
        self.gate_up = make_linear(gate_up, None, weight_format, device, precise)
        self.down = make_linear(weight("mlp.down_proj.weight"), None, weight_format, device, precise,
                                exact_sums=True)
        self.rotary = rotary


class Gemma3Model(DecoderModel):
    def __init__(self, config: ModelConfig, weights: dict, weight_format: str, device: torch.device,
                 part: ModelPart | None = None):
        if config.layer_windows is None:
            raise ValueError("a Gemma 3 config carries layer_windows (model/loader.py sets them)")
        part = part or ModelPart.whole(config.num_layers)
        self.config = config
        self.weight_format = weight_format
        self.device = device
        self.dtype = ACTIVATION_DTYPE[weight_format]
        embed = weights.pop("model.embed_tokens.weight", None)
        self.embed_tokens = EmbeddingTable(embed, self.dtype, device) if part.embed else None
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5, dtype=self.dtype)
        lm_head = weights.pop("lm_head.weight", None)
        self.lm_head = make_linear(embed if lm_head is None else lm_head, None, weight_format, device,
                                   precise_activations(weight_format)) if part.head else None
        self.norm = as_dense(weights.pop("model.norm.weight")).to(device=device, dtype=self.dtype)
        self.rotary, self.local_rotary = self.make_rotaries(config, device)
        self.layer_indices = part.layers
        self.layers = [self.make_layer(config, weights, i, weight_format, device) for i in part.layers]
        self.init_ops(config, self.rotary, weight_format, device)

    def make_rotaries(self, config: ModelConfig, device: torch.device) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        """The RoPE of the full-attention layers and of the sliding ones."""
        local_config = replace(config, rope_theta=config.rope_local_theta or config.rope_theta, rope_scaling=None)
        return (RotaryEmbedding(config, config.max_model_len, device, torch.float32),
                RotaryEmbedding(local_config, config.max_model_len, device, torch.float32))

    def make_layer(self, config: ModelConfig, weights: dict, index: int, weight_format: str, device: torch.device):
        return Gemma3Layer(config, weights, f"model.layers.{index}", weight_format, device,
                           self.rotary if config.window_of(index) is None else self.local_rotary)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], count: int, start: int = 0) -> torch.Tensor:
        ops = self.ops
        tables = {id(rotary): ops.rope_tables(positions, rotary) for rotary in (self.rotary, self.local_rotary)}
        for index, layer, (key_cache, value_cache) in zip(self.layer_indices[start:count], self.layers[start:count],
                                                          kv_caches[start:count]):
            qkv = layer.qkv(ops.rms_norm(hidden, layer.input_norm)).float()
            qkv = ops.normalize_heads(qkv, layer.q_norm, layer.k_norm)
            attended = ops.attention(qkv, positions, key_cache, value_cache, metadata.for_layer(index),
                                     tables[id(layer.rotary)], layer.rotary)
            attended = layer.o_proj(attended.to(self.dtype)).to(self.dtype)
            hidden = hidden + ops.rms_norm(attended, layer.post_attention_norm)
            gate_up = layer.gate_up(ops.rms_norm(hidden, layer.pre_feedforward_norm))
            feed_forward = layer.down(ops.gelu_tanh_mul(gate_up)).to(self.dtype)
            hidden = hidden + ops.rms_norm(feed_forward, layer.post_feedforward_norm)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
