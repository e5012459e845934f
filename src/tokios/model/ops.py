"""The elementwise and attention operations of a decoder layer, in two implementations chosen
once at model construction:

- TorchOps: plain PyTorch (any device, any dtype). The float32 reference path.
- CpuKernelOps: the C++ kernels of model/kernels (quantized weights on the CPU). Decode rows go
  through the same C++ functions that the fused decode step (FusedDecoder) runs, so a request's
  tokens are computed identically whether its step was decode-only (fused) or mixed with
  prefill chunks (per-op), and whatever the batch size.

Both take the fused qkv projection [num_tokens, (heads + 2 * kv_heads) * head_dim], rotate q and
k, write k and v to the paged cache, and attend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokios.config import ModelConfig
from tokios.kv_cache.layout import KVCacheLayout
from tokios.model.attention import AttentionMetadata, paged_attention, write_kv
from tokios.model.rope import RotaryEmbedding


class TorchOps:
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding):
        self.config = config
        self.rotary = rotary
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def normalize_heads(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
        """RMSNorm over head_dim of every query and key head (Gemma 3), before the rotation."""
        head_dim = self.config.head_dim
        num_tokens = qkv.shape[0]
        query = self.rms_norm(qkv[:, :self.q_size].reshape(-1, head_dim), q_norm).view(num_tokens, self.q_size)
        key = self.rms_norm(qkv[:, self.q_size:self.q_size + self.kv_size].reshape(-1, head_dim),
                            k_norm).view(num_tokens, self.kv_size)
        return torch.cat([query, key, qkv[:, self.q_size + self.kv_size:]], dim=1)

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, metadata: AttentionMetadata, rope_tables,
                  rotary: RotaryEmbedding | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """-> attended [num_tokens, heads * head_dim]. rotary: the layer's own RoPE (a model with
        one base per layer kind), whose rope_tables(positions, rotary) these are. sinks
        [heads] float32: the layer's attention sinks (gpt-oss), or None."""
        config = self.config
        rotary = rotary or self.rotary
        num_tokens = qkv.shape[0]
        cos, sin = rope_tables
        query = qkv[:, :self.q_size].view(num_tokens, config.num_heads, config.head_dim)
        key = qkv[:, self.q_size:self.q_size + self.kv_size].view(num_tokens, config.num_kv_heads, config.head_dim)
        value = qkv[:, self.q_size + self.kv_size:].view(num_tokens, config.num_kv_heads, config.head_dim)
        query = rotary.apply(query.float(), cos, sin)
        key = rotary.apply(key.float(), cos, sin)
        write_kv(key_cache, value_cache, key, value, metadata.slot_mapping)
        attended = paged_attention(query, key_cache, value_cache, metadata, self.scale, sinks)
        return attended.reshape(num_tokens, self.q_size)

    def rope_tables(self, positions: torch.Tensor, rotary: RotaryEmbedding | None = None):
        return (rotary or self.rotary).tables(positions)


class CpuKernelOps(TorchOps):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, extension):
        super().__init__(config, rotary)
        self.extension = extension

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.extension.rms_norm(x, weight, self.config.rms_norm_eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.extension.glu_mul(gate_up, False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.extension.glu_mul(gate_up, True)

    def rope_tables(self, positions: torch.Tensor, rotary: RotaryEmbedding | None = None):
        return None  # the kernel indexes the full tables by position itself

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, metadata: AttentionMetadata, rope_tables,
                  rotary: RotaryEmbedding | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        config = self.config
        rotary = rotary or self.rotary
        qkv = qkv.contiguous()
        self.extension.rope_write_kv(qkv, positions, rotary.cos, rotary.sin, key_cache, value_cache,
                                     metadata.slot_mapping, config.num_heads, config.num_kv_heads, config.head_dim)
        num_tokens = qkv.shape[0]
        num_decode = metadata.num_decode_tokens
        attended = torch.empty(num_tokens, self.q_size, dtype=qkv.dtype)
        if num_decode:
            attended[:num_decode] = self.extension.decode_attention(
                qkv[:num_decode], key_cache, value_cache, metadata.decode_slot_indices, metadata.decode_context_lens,
                config.num_heads, config.num_kv_heads, config.head_dim, self.scale, sinks)
        if metadata.spans:
            # Prefill chunks: one SDPA per span (a matrix product over the chunk).
            query = qkv[:, :self.q_size].view(num_tokens, config.num_heads, config.head_dim)
            span_metadata = AttentionMetadata(metadata.slot_mapping, 0, spans=metadata.spans)
            attended[num_decode:] = paged_attention(query, key_cache, value_cache, span_metadata, self.scale,
                                                    sinks)[num_decode:].reshape(-1, self.q_size)
        return attended

    def fused_decoder(self, model, kv_caches, num_layers: int | None = None):
        """The all-layers C++ decode step over these caches (built once per cache list); with
        num_layers, over the first layers only (speculative self-draft). A Gemma-style layer
        (pre_feedforward_norm) brings its extra norms, its own RoPE table and tanh-GELU; a layer
        with per-head q/k norms (Gemma 3, Qwen3) brings those, one with attention sinks (gpt-oss)
        its sinks, a mixture of experts its packed experts."""
        layers = model.layers[:num_layers]
        kv_caches = kv_caches[:len(layers)]
        config = self.config
        is_gemma = hasattr(layers[0], "pre_feedforward_norm")
        rotaries = [getattr(layer, "rotary", self.rotary) for layer in layers]
        has_head_norms = hasattr(layers[0], "q_norm")

        def optional(name: str, present: bool = is_gemma) -> list:
            return [getattr(layer, name) for layer in layers] if present else []

        layer_to_group = KVCacheLayout.for_config(config).layer_to_group
        layer_groups = [layer_to_group[index] for index in model.layer_indices[:len(layers)]]
        # A mixture of experts' layers bring their C++ SparseExperts (model/kernels/experts.py)
        # in place of the gated MLP's two products.
        is_moe = config.num_experts > 0
        return self.extension.FusedDecoder(
            [layer.input_norm for layer in layers],
            [layer.pre_feedforward_norm if is_gemma else layer.post_attention_norm for layer in layers],
            [layer.qkv.linear for layer in layers], [layer.o_proj.linear for layer in layers],
            [] if is_moe else [layer.gate_up.linear for layer in layers],
            [] if is_moe else [layer.down.linear for layer in layers],
            [k for k, _ in kv_caches], [v for _, v in kv_caches],
            [r.cos for r in rotaries], [r.sin for r in rotaries], config.num_heads, config.num_kv_heads,
            config.head_dim, config.hidden_size, config.intermediate_size, config.rms_norm_eps, self.scale, is_gemma,
            optional("post_attention_norm"), optional("post_feedforward_norm"), optional("q_norm", has_head_norms),
            optional("k_norm", has_head_norms), layer_groups,
            [layer.feed_forward.kernel for layer in layers] if is_moe else [],
            [layer.sinks for layer in layers] if getattr(layers[0], "sinks", None) is not None else [])


def fused_decode_inputs(metadata: AttentionMetadata) -> tuple[list, list, list]:
    """Per KV group: (slot mappings, decode slot tables, decode context lengths) of a decode-only step."""
    groups = metadata.groups or [metadata]
    return ([g.slot_mapping for g in groups], [g.decode_slot_indices for g in groups],
            [g.decode_context_lens for g in groups])
