"""The Llama family (Llama, SmolLM, Mistral, Qwen2 with QKV bias) as one forward pass.

The file describes the maths only: weight formats come in through model/linear.py, the paged
KV cache and batch layout through AttentionMetadata (model/attention.py). Q, K and V share one
fused projection, and gate/up share another, so a decode step issues 4 matrix products per layer.
Weights arrive as a dict in Hugging Face names (model.layers.N.self_attn.q_proj.weight, ...),
whatever file they came from. The feed-forward is model/mlp.py's: the gated MLP, or the sparse
MoE of a mixture-of-experts file (Mixtral, Qwen2/3-MoE, OLMoE run this loop).
"""

from __future__ import annotations

import torch

from tokios.config import ModelConfig
from tokios.model.attention import AttentionMetadata
from tokios.model.kernels import precise_activations
from tokios.model.linear import make_linear
from tokios.model.decoder import DecoderModel, ModelPart, make_ops
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.mlp import make_feed_forward
from tokios.model.moe import ExpertActivation
from tokios.model.quant import EmbeddingTable, as_dense, concat_rows
from tokios.model.rope import RotaryEmbedding


class LlamaLayer:
    """One decoder layer's weights. ops: the model's (the dense feed-forward's GLU is theirs).
    Biases on q, k, v and o where the file has them."""

    # How a mixture of experts' expert combines gate and up (model/moe.py).
    expert_activation = ExpertActivation("silu")
    sinks = None  # [num_heads] float32 attention sinks, where the architecture has them (gpt-oss)

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], prefix: str, weight_format: str,
                 device: torch.device, ops):
        def weight(name: str) -> torch.Tensor:
            return weights.pop(f"{prefix}.{name}")

        def bias(name: str) -> torch.Tensor | None:
            return weights.pop(f"{prefix}.{name}", None)

        dtype = ACTIVATION_DTYPE[weight_format]
        precise = precise_activations(weight_format)
        self.input_norm = as_dense(weight("input_layernorm.weight")).to(device=device, dtype=dtype)
        self.post_attention_norm = as_dense(weight("post_attention_layernorm.weight")).to(device=device, dtype=dtype)
        qkv_weight = concat_rows([weight("self_attn.q_proj.weight"), weight("self_attn.k_proj.weight"),
                                  weight("self_attn.v_proj.weight")])
        qkv_biases = [bias(f"self_attn.{n}_proj.bias") for n in "qkv"]
        qkv_bias = torch.cat([as_dense(b) for b in qkv_biases]) if all(b is not None for b in qkv_biases) else None
        self.qkv = make_linear(qkv_weight, qkv_bias, weight_format, device, precise)
        o_bias = bias("self_attn.o_proj.bias")
        self.o_proj = make_linear(weight("self_attn.o_proj.weight"), None if o_bias is None else as_dense(o_bias),
                                  weight_format, device, precise, exact_sums=True)
        self.feed_forward = make_feed_forward(config, weights, prefix, weight_format, device, precise, ops,
                                              self.expert_activation)

    # The fused decode step (model/ops.py) reads a dense layer's two feed-forward products.
    @property
    def gate_up(self):
        return self.feed_forward.gate_up

    @property
    def down(self):
        return self.feed_forward.down


class LlamaModel(DecoderModel):
    layer_class = LlamaLayer

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], weight_format: str,
                 device: torch.device, part: ModelPart | None = None):
        part = part or ModelPart.whole(config.num_layers)
        self.config = config
        self.weight_format = weight_format
        self.device = device
        self.dtype = ACTIVATION_DTYPE[weight_format]
        embed = weights.pop("model.embed_tokens.weight", None)
        lm_head = weights.pop("lm_head.weight", None)
        # The embedding table is only gathered from (a row per token): kept in the file's blocks,
        # only the rows a step asks for are dequantized (a 152k-token vocabulary's table is
        # 0.6 GB as float32, 0.13 GB as a file's Q6_K).
        self.embed_tokens = EmbeddingTable(embed, self.dtype, device) if part.embed else None
        # The output projection decides every token's ranking; 4-bit blocks there cost more
        # accuracy than anywhere else, so int4 keeps it at 8 bits (as llama.cpp's Q4 files do).
        head_format = "int8" if weight_format == "int4" else weight_format
        self.lm_head = make_linear(embed if lm_head is None else lm_head, None, head_format, device,
                                   precise_activations(weight_format)) if part.head else None
        self.norm = as_dense(weights.pop("model.norm.weight")).to(device=device, dtype=self.dtype)
        self.layer_indices = part.layers
        self.rotary = RotaryEmbedding(config, config.max_model_len, device, torch.float32)
        ops = make_ops(config, self.rotary, weight_format, device)  # before the layers, which take its GLU
        self.layers = [self.layer_class(config, weights, f"model.layers.{i}", weight_format, device, ops)
                       for i in part.layers]
        self.init_ops(config, self.rotary, weight_format, device, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], count: int, start: int = 0) -> torch.Tensor:
        ops = self.ops
        rope_tables = ops.rope_tables(positions)
        for index, layer, (key_cache, value_cache) in zip(self.layer_indices[start:count], self.layers[start:count],
                                                          kv_caches[start:count]):
            qkv = self.project_qkv(layer, hidden)
            # for_layer: the layer's KV group's metadata where layers differ in window (gpt-oss)
            attended = ops.attention(qkv, positions, key_cache, value_cache, metadata.for_layer(index), rope_tables,
                                     sinks=layer.sinks)
            hidden = hidden + layer.o_proj(attended.to(self.dtype)).to(self.dtype)
            hidden = hidden + layer.feed_forward(ops.rms_norm(hidden, layer.post_attention_norm)).to(self.dtype)
        return hidden

    def project_qkv(self, layer: LlamaLayer, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's fused q, k, v rows for its input `hidden`, before RoPE."""
        return layer.qkv(self.ops.rms_norm(hidden, layer.input_norm))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_rows, hidden] -> float32 logits [num_rows, vocab]."""
        return self.lm_head(hidden).float()
