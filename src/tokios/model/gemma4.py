"""Gemma 4's text decoder, dense or with its MoE block: what differs from Gemma 3
(model/gemma3.py), all read from the file by the loader (model/gemma4_metadata.py):

- heads of two sizes: the full-attention layers have wider heads (and their own KV head count,
  config.layer_kv_shapes), with "proportional" RoPE: base 1e6 over the whole wide head, whose
  tail the converter's rope_freqs table leaves unrotated; sliding layers rotate their whole head;
- attention is unscaled (scale 1); values get an RMSNorm without weights;
- k = v: a full-attention layer may have no value projection, its values are its keys before
  their norm and rotation;
- the last layers compute no K/V: they attend over the cache of the last earlier layer of their
  kind (config.kv_source_layers; kv_cache/layout.py gives them no cache of their own);
- per-layer input embeddings: a second table gives every token a small vector per layer, mixed
  with a projection of the token's embedding; after its feed-forward each layer adds a gated
  projection of its vector (GELU gate, norm) to the residual, then scales the residual by its
  own scalar;
- norms multiply by their weights as stored (the converter writes them unshifted);
- the MoE variant (26B-A4B) adds routed experts (tanh-GELU) beside each layer's dense MLP: the
  shared sparse MoE of model/moe.py, its router reading the residual normed without weights
  (times a learned scale and hidden^-1/2), softmax, top k renormalised, then a learned scale
  per expert (llama.cpp's ffn_down_exps.scale); each branch gets its own post-norm before their
  sum meets the layer's post-feedforward norm.

Heads of two widths do not fit the C++ attention and fused decode step, so the ops are
PyTorch's (model/ops.py TorchOps); the linear layers still run on the file's blocks. The
per-layer inputs come from the step's token ids, so a Gemma 4 runs whole in one process and
without layer slices.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from tokios.config import ModelConfig
from tokios.errors import UnsupportedError
from tokios.model.attention import AttentionMetadata, paged_attention, write_kv
from tokios.model.decoder import ModelPart
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.gemma3 import Gemma3Model
from tokios.model.kernels import precise_activations
from tokios.model.linear import make_linear
from tokios.model.moe import ExpertActivation, make_sparse_moe, routing_of
from tokios.model.ops import TorchOps
from tokios.model.quant import EmbeddingTable, as_dense, concat_rows
from tokios.model.rope import RotaryEmbedding


class Gemma4Layer:
    def __init__(self, config: ModelConfig, weights: dict, index: int, weight_format: str, device: torch.device,
                 rotary: RotaryEmbedding):
        prefix = f"model.layers.{index}"

        def weight(name: str):
            return weights.pop(f"{prefix}.{name}")

        dtype = ACTIVATION_DTYPE[weight_format]
        precise = precise_activations(weight_format)

        def dense(name: str, dtype: torch.dtype = dtype) -> torch.Tensor:
            return as_dense(weight(name)).to(device=device, dtype=dtype)

        def linear(tensor, exact_sums: bool = False):
            return make_linear(tensor, None, weight_format, device, precise, exact_sums)

        self.input_norm = dense("input_layernorm.weight")
        self.post_attention_norm = dense("post_attention_layernorm.weight")
        self.pre_feedforward_norm = dense("pre_feedforward_layernorm.weight")
        self.post_feedforward_norm = dense("post_feedforward_layernorm.weight")
        self.num_kv_heads, self.head_dim = config.kv_shape_of(index)
        self.q_size = config.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.stores_kv = config.kv_source_of(index) == index
        self.q_norm = dense("self_attn.q_norm.weight", torch.float32)
        projections = [weight("self_attn.q_proj.weight")]
        if self.stores_kv:
            self.k_norm = dense("self_attn.k_norm.weight", torch.float32)
            projections.append(weight("self_attn.k_proj.weight"))
            value = weights.pop(f"{prefix}.self_attn.v_proj.weight", None)
            self.has_value_projection = value is not None
            projections += [value] if self.has_value_projection else []
        self.qkv = linear(concat_rows(projections))
        self.o_proj = linear(weight("self_attn.o_proj.weight"), exact_sums=True)
        self.gate_up = linear(concat_rows([weight("mlp.gate_proj.weight"), weight("mlp.up_proj.weight")]))
        self.down = linear(weight("mlp.down_proj.weight"), exact_sums=True)
        self.has_per_layer_input = f"{prefix}.per_layer_input_gate.weight" in weights
        if self.has_per_layer_input:
            self.per_layer_gate = linear(weight("per_layer_input_gate.weight"))
            self.per_layer_projection = linear(weight("per_layer_projection.weight"))
            self.post_per_layer_norm = dense("post_per_layer_input_norm.weight")
        scalar = weights.pop(f"{prefix}.layer_scalar", None)
        self.output_scale = None if scalar is None else as_dense(scalar).to(device=device, dtype=dtype)
        self.rotary = rotary
        # The MoE variant (Gemma 4 26B-A4B): routed experts beside the dense MLP, on the same
        # residual, each branch with its own post-norm. The router reads the residual normed
        # without weights, times its own scale and hidden^-1/2 (folded into the router here).
        self.moe = None
        if config.num_experts:
            router = f"{prefix}.mlp.gate.weight"
            router_scale = as_dense(weight("mlp.gate.scale")).float() * config.hidden_size ** -0.5
            weights[router] = as_dense(weights[router]).float() * router_scale
            self.pre_experts_norm = dense("pre_feedforward_layernorm_2.weight")
            self.post_mlp_norm = dense("post_feedforward_layernorm_1.weight")
            self.post_experts_norm = dense("post_feedforward_layernorm_2.weight")
            self.moe = make_sparse_moe(config, weights, prefix, routing_of(config), ExpertActivation("gelu_tanh"),
                                       weight_format, device, dtype)


class Gemma4Model(Gemma3Model):
    # Each layer needs the step's per-layer inputs, made from the token ids (forward()).
    supports_layer_slices = False

    def __init__(self, config: ModelConfig, weights: dict, weight_format: str, device: torch.device,
                 part: ModelPart | None = None):
        if part is not None and part != ModelPart.whole(config.num_layers):
            raise UnsupportedError("gemma4 runs whole in one process: its per-layer input embeddings and "
                                   "layers reading earlier layers' K/V are not split across a parallel group")
        dtype = ACTIVATION_DTYPE[weight_format]
        per_layer_table = weights.pop("model.embed_tokens_per_layer.weight", None)
        self.embed_tokens_per_layer = None
        if per_layer_table is not None:
            self.embed_tokens_per_layer = EmbeddingTable(per_layer_table, dtype, device)
            self.per_layer_size = self.embed_tokens_per_layer.dim // config.num_layers
            self.per_layer_model_projection = make_linear(
                weights.pop("model.per_layer_model_projection.weight"), None, weight_format, device,
                precise_activations(weight_format))
            self.per_layer_projection_norm = as_dense(weights.pop("model.per_layer_projection_norm.weight")).to(
                device=device, dtype=dtype)
        super().__init__(config, weights, weight_format, device, part)

    def make_rotaries(self, config: ModelConfig, device: torch.device) -> tuple[RotaryEmbedding, RotaryEmbedding]:
        windows = [config.window_of(layer) for layer in range(config.num_layers)]
        full_head_dim = next((config.kv_shape_of(i)[1] for i, w in enumerate(windows) if w is None), config.head_dim)
        sliding_head_dim = next((config.kv_shape_of(i)[1] for i, w in enumerate(windows) if w is not None),
                                config.head_dim)
        # The file's rope_freqs table (config.rope_scaling) belongs to the full-attention layers only.
        full = replace(config, head_dim=full_head_dim)
        sliding = replace(config, head_dim=sliding_head_dim, rope_theta=config.rope_local_theta or config.rope_theta,
                          rope_scaling=None)
        return (RotaryEmbedding(full, config.max_model_len, device, torch.float32),
                RotaryEmbedding(sliding, config.max_model_len, device, torch.float32))

    def make_layer(self, config: ModelConfig, weights: dict, index: int, weight_format: str, device: torch.device):
        return Gemma4Layer(config, weights, index, weight_format, device,
                           self.rotary if config.window_of(index) is None else self.local_rotary)

    def init_ops(self, config, rotary, weight_format: str, device: torch.device) -> None:
        self.ops = TorchOps(config, rotary)
        self.has_decode_attention_kernel = False
        self.can_fuse_decode = False
        self._fused_by_num_layers = {}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None = None) -> torch.Tensor:
        hidden = self.embed(input_ids)
        per_layer_inputs = self.per_layer_inputs(input_ids, hidden)
        hidden = self.layer_loop(hidden, positions, metadata, kv_caches, self.num_local_layers(num_layers),
                                 per_layer_inputs=per_layer_inputs)
        return self.ops.rms_norm(hidden, self.norm)

    def per_layer_inputs(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_tokens, num_layers, per_layer_size]: each token's own vector per layer (scaled by
        sqrt(size)) and the normed projection of its embedding (scaled by 1/sqrt(hidden)),
        averaged in the 1/sqrt(2) sense; None without a per-layer table."""
        if self.embed_tokens_per_layer is None:
            return None
        shape = (input_ids.shape[0], self.config.num_layers, self.per_layer_size)
        from_tokens = self.embed_tokens_per_layer(input_ids).view(shape) * self.per_layer_size ** 0.5
        projected = self.per_layer_model_projection(hidden).to(self.dtype).view(shape) * self.config.hidden_size ** -0.5
        projected = self.ops.rms_norm(projected, self.per_layer_projection_norm)
        return (projected + from_tokens) * 2 ** -0.5

    def attend(self, layer: Gemma4Layer, normed: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               metadata: AttentionMetadata, rope_tables) -> torch.Tensor:
        """normed [num_tokens, hidden] -> attended [num_tokens, heads * the layer's head_dim]."""
        num_tokens = normed.shape[0]
        cos, sin = rope_tables
        projected = layer.qkv(normed).float()
        query = projected[:, :layer.q_size].view(num_tokens, self.config.num_heads, layer.head_dim)
        query = layer.rotary.apply(self.ops.rms_norm(query, layer.q_norm), cos, sin)
        if layer.stores_kv:
            key = projected[:, layer.q_size:layer.q_size + layer.kv_size].view(num_tokens, layer.num_kv_heads,
                                                                             layer.head_dim)
            value = (projected[:, layer.q_size + layer.kv_size:].view(key.shape) if layer.has_value_projection
                     else key)
            key = layer.rotary.apply(self.ops.rms_norm(key, layer.k_norm), cos, sin)
            write_kv(key_cache, value_cache, key, self.ops.rms_norm(value, None), metadata.slot_mapping)
        return paged_attention(query, key_cache, value_cache, metadata,
                               self.config.attention_scale).reshape(num_tokens, layer.q_size)

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], count: int, start: int = 0,
                   per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Gemma 3's layer (attention and feed-forward between their four norms; the MoE
        variant's experts beside the feed-forward), then the per-layer input and the layer's
        output scale."""
        ops = self.ops
        tables = {id(rotary): rotary.tables(positions) for rotary in (self.rotary, self.local_rotary)}
        for index, layer, (key_cache, value_cache) in zip(self.layer_indices[start:count], self.layers[start:count],
                                                          kv_caches[start:count]):
            attended = self.attend(layer, ops.rms_norm(hidden, layer.input_norm), key_cache, value_cache,
                                   metadata.for_layer(index), tables[id(layer.rotary)])
            attended = layer.o_proj(attended.to(self.dtype)).to(self.dtype)
            hidden = hidden + ops.rms_norm(attended, layer.post_attention_norm)
            gate_up = layer.gate_up(ops.rms_norm(hidden, layer.pre_feedforward_norm))
            feed_forward = layer.down(ops.gelu_tanh_mul(gate_up)).to(self.dtype)
            if layer.moe is not None:
                experts = layer.moe(ops.rms_norm(hidden, layer.pre_experts_norm), ops.rms_norm(hidden, None))
                feed_forward = (ops.rms_norm(feed_forward, layer.post_mlp_norm)
                                + ops.rms_norm(experts.to(self.dtype), layer.post_experts_norm))
            hidden = hidden + ops.rms_norm(feed_forward, layer.post_feedforward_norm)
            if per_layer_inputs is not None and layer.has_per_layer_input:
                gate = F.gelu(layer.per_layer_gate(hidden).to(self.dtype), approximate="tanh")
                projected = layer.per_layer_projection(gate * per_layer_inputs[:, index]).to(self.dtype)
                hidden = hidden + ops.rms_norm(projected, layer.post_per_layer_norm)
            if layer.output_scale is not None:
                hidden = hidden * layer.output_scale
        return hidden
