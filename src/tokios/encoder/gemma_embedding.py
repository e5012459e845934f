"""EmbeddingGemma (llama.cpp's `gemma-embedding`; transformers' Gemma3TextModel with
use_bidirectional_attention): Gemma 3's layers (model/gemma3.py's Gemma3Layer: four norms,
per-head q/k norms, GeGLU with tanh GELU, the sqrt(hidden) embedding scale, a RoPE base of its
own on sliding layers) read as an encoder.

What differs from the decoder: no causal mask, and a sliding layer attends to the positions
within window // 2 on either side of a token, |i - j| <= window // 2 (transformers halves the
file's `sliding_window` for the bidirectional model; llama.cpp's symmetric window does the same);
the final norm's output is the hidden state pooled (no logits). Its Dense projections and
normalisation are heads.py's, as the file declares them.

Norm weights: llama.cpp's converter stores Gemma's (1 + w); a Hugging Face checkpoint holds w,
so its norms get the 1 added at load (config.norm_offset). Attention scale: the checkpoint's
query_pre_attn_scalar; a GGUF has none and llama.cpp scales by head_dim, as every EmbeddingGemma
checkpoint declares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from tokios.config import ModelConfig
from tokios.encoder.attention import packed_attention
from tokios.encoder.batch import EncoderBatch
from tokios.encoder.names import gguf_tensor_name
from tokios.errors import UnsupportedError
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.gemma3 import Gemma3Layer
from tokios.model.gemma3_metadata import LOCAL_ROPE_BASE, SLIDING_WINDOW_PATTERN, sliding_fields
from tokios.model.loader import GGUF_LAYER_NAMES_BY_ARCHITECTURE
from tokios.model.ops import TorchOps
from tokios.model.quant import EmbeddingTable, as_dense
from tokios.model.rope import RotaryEmbedding

GGUF_TO_HF_LAYER_NAMES = GGUF_LAYER_NAMES_BY_ARCHITECTURE["gemma3"]
_HF_TO_GGUF_LAYER_NAMES = {hf: gguf for gguf, hf in GGUF_TO_HF_LAYER_NAMES.items()}
_HF_TOP_NAMES = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}


@dataclass(frozen=True)
class GemmaEmbeddingConfig:
    name: str
    layers: ModelConfig  # Gemma 3's shapes, per-layer windows and RoPE bases, as model/gemma3.py reads them
    norm_offset: float  # added to every norm weight: 1.0 for a Hugging Face checkpoint, 0.0 for a GGUF

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def max_positions(self) -> int:
        return self.layers.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.layers.vocab_size


def config_from_gguf(metadata: Mapping[str, Any], architecture: str, name: str) -> GemmaEmbeddingConfig:
    def key(suffix: str, default: Any = None) -> Any:
        value = metadata.get(f"{architecture}.{suffix}", default)
        if value is None:
            raise UnsupportedError(f"{name}: GGUF metadata lacks {architecture}.{suffix}")
        return value

    num_layers = int(key("block_count"))
    fields = sliding_fields(dict(metadata), architecture, name, num_layers)
    fields.pop("final_logit_softcapping")  # a cap on logits, which an encoder does not make
    num_heads = int(key("attention.head_count"))
    hidden_size = int(key("embedding_length"))
    layers = ModelConfig(
        architecture="gemma3", num_layers=num_layers, hidden_size=hidden_size,
        intermediate_size=int(key("feed_forward_length")), num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden_size // num_heads)),
        vocab_size=len(metadata["tokenizer.ggml.tokens"]), max_model_len=int(key("context_length")),
        rope_theta=float(key("rope.freq_base")), rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        name=name, **fields)
    return GemmaEmbeddingConfig(name=name, layers=layers, norm_offset=0.0)


def config_from_hf(config: Mapping[str, Any], name: str) -> GemmaEmbeddingConfig:
    if not config.get("use_bidirectional_attention"):
        raise UnsupportedError(f"{name}: a Gemma3TextModel without use_bidirectional_attention is a decoder, not "
                               "an EmbeddingGemma encoder")
    for key in ("attn_logit_softcapping", "rope_scaling"):
        if config.get(key) is not None:
            raise UnsupportedError(f"{name}: Gemma 3 {key} {config[key]!r} is not supported (null)")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise UnsupportedError(f"{name}: Gemma 3 hidden_activation {activation!r} is not supported (gelu_pytorch_tanh)")
    rope = config.get("rope_parameters") or {}
    for kind in ("full_attention", "sliding_attention"):
        if (rope.get(kind) or {}).get("rope_type", "default") != "default":
            raise UnsupportedError(f"{name}: Gemma 3 {kind} rope_type {rope[kind]['rope_type']!r} is not supported "
                                   "(default)")
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "full_attention" if (index + 1) % config.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN) == 0
        else "sliding_attention" for index in range(num_layers)]
    num_heads = config["num_attention_heads"]
    layers = ModelConfig(
        architecture="gemma3", num_layers=num_layers, hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads", num_heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // num_heads, vocab_size=config["vocab_size"],
        max_model_len=config["max_position_embeddings"],
        rope_theta=float((rope.get("full_attention") or {}).get("rope_theta", config.get("rope_theta", 1e6))),
        rope_local_theta=float((rope.get("sliding_attention") or {}).get(
            "rope_theta", config.get("rope_local_base_freq", LOCAL_ROPE_BASE))),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), name=name,
        # As the file has it (transformers' config halves it when it loads; to_dict writes it back).
        layer_windows=tuple(config["sliding_window"] if kind == "sliding_attention" else None for kind in layer_types),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)))
    return GemmaEmbeddingConfig(name=name, layers=layers, norm_offset=1.0)


def hf_name_to_gguf(name: str) -> str | None:
    """A Gemma3TextModel tensor name -> llama.cpp's."""
    return gguf_tensor_name(name.removeprefix("model."), _HF_TOP_NAMES, "layers.", _HF_TO_GGUF_LAYER_NAMES,
                            "EmbeddingGemma")


class GemmaEmbeddingModel:
    def __init__(self, config: GemmaEmbeddingConfig, weights: dict, weight_format: str, device: torch.device):
        self.config = config
        layers_config = config.layers
        dtype = ACTIVATION_DTYPE[weight_format]
        self.embed_tokens = EmbeddingTable(weights.pop("token_embd.weight"), dtype, device)
        self.embed_scale = torch.tensor(layers_config.hidden_size ** 0.5, dtype=dtype)
        self.norm = (as_dense(weights.pop("output_norm.weight")) + config.norm_offset).to(device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(layers_config, layers_config.max_model_len, device, torch.float32)
        local_config = replace(layers_config, rope_theta=layers_config.rope_local_theta or layers_config.rope_theta)
        self.local_rotary = RotaryEmbedding(local_config, layers_config.max_model_len, device, torch.float32)
        self.ops = TorchOps(layers_config, self.rotary)
        self.layers = []
        for index in range(layers_config.num_layers):
            prefix = f"model.layers.{index}"
            layer_weights = {}
            for gguf_name, hf_name in GGUF_TO_HF_LAYER_NAMES.items():
                weight = weights.pop(f"blk.{index}.{gguf_name}", None)
                if weight is not None:
                    is_norm = gguf_name.endswith("norm.weight")
                    layer_weights[f"{prefix}.{hf_name}"] = as_dense(weight) + config.norm_offset if is_norm else weight
            rotary = self.rotary if layers_config.window_of(index) is None else self.local_rotary
            self.layers.append(Gemma3Layer(layers_config, layer_weights, prefix, weight_format, device, rotary))
            if layer_weights:
                raise UnsupportedError(f"{config.name}: tensors {sorted(layer_weights)} are not part of EmbeddingGemma")

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """-> final hidden states [num_tokens, hidden], normed."""
        config, ops = self.config.layers, self.ops
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        tables = {id(rotary): rotary.tables(batch.positions) for rotary in (self.rotary, self.local_rotary)}
        hidden = self.embed_tokens(batch.input_ids) * self.embed_scale
        for index, layer in enumerate(self.layers):
            qkv = ops.normalize_heads(layer.qkv(ops.rms_norm(hidden, layer.input_norm)).float(), layer.q_norm,
                                      layer.k_norm)
            query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
            cos, sin = tables[id(layer.rotary)]
            query = layer.rotary.apply(query.reshape(-1, config.num_heads, config.head_dim), cos, sin)
            key = layer.rotary.apply(key.reshape(-1, config.num_kv_heads, config.head_dim), cos, sin)
            window = config.window_of(index)
            # |i - j| <= window // 2 is packed_attention's |i - j| < window // 2 + 1.
            value = value.reshape(-1, config.num_kv_heads, config.head_dim)
            attended = packed_attention(query, key, value, batch, scale=config.attention_scale,
                                        window=None if window is None else window // 2 + 1)
            hidden = hidden + ops.rms_norm(layer.o_proj(attended.to(hidden.dtype)), layer.post_attention_norm)
            gate_up = layer.gate_up(ops.rms_norm(hidden, layer.pre_feedforward_norm))
            feed_forward = layer.down(ops.gelu_tanh_mul(gate_up))
            hidden = hidden + ops.rms_norm(feed_forward.to(hidden.dtype), layer.post_feedforward_norm)
        return ops.rms_norm(hidden, self.norm)


Model = GemmaEmbeddingModel
