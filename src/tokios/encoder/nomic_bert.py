"""nomic-bert (nomic-embed-text v1 / v1.5): BERT with rotary positions and a SwiGLU MLP.

What differs from BERT (bert.py): no learned position table, RoPE on queries and keys instead
(NEOX "rotate half", over the whole head; llama.cpp's converter leaves Q/K unpermuted);
one fused, bias-free qkv projection (`attn_qkv`, nomic's Wqkv); the feed-forward is
down(silu(gate) * up) without biases. Post-norm and token-type embeddings as BERT.
The mixture-of-experts variant (nomic-bert-moe: GELU experts with biases, an XLM-R vocabulary)
is not implemented; its files are refused by architecture name.

A Hugging Face directory holds nomic's own names (Wqkv, fc11 = up, fc12 = gate, norm1/norm2:
what transformers' NomicBertModel saves too) and nomic's config keys (n_embd, rotary_emb_*), with
transformers' (hidden_size, rope_parameters) beside them where transformers wrote the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from tokios.encoder import bert
from tokios.encoder.attention import packed_attention, rotary_embedding
from tokios.encoder.batch import EncoderBatch
from tokios.encoder.names import gguf_tensor_name
from tokios.errors import UnsupportedError
from tokios.model.linear import make_linear
from tokios.model.quant import EmbeddingTable, as_dense, concat_rows

DEFAULT_ROPE_THETA = 1000.0  # nomic's rotary_emb_base


@dataclass(frozen=True)
class NomicBertConfig(bert.BertConfig):
    rope_theta: float = DEFAULT_ROPE_THETA


def config_from_gguf(metadata: Mapping[str, Any], architecture: str, name: str) -> NomicBertConfig:
    shape = bert.config_from_gguf(metadata, architecture, name)
    return NomicBertConfig(**vars(shape), rope_theta=float(metadata.get(f"{architecture}.rope.freq_base",
                                                                        DEFAULT_ROPE_THETA)))


# nomic's config keys that this module does not implement, and the value it does.
_REQUIRED = {"prenorm": False, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
             "rotary_emb_scale_base": None, "rotary_scaling_factor": None, "qkv_proj_bias": False,
             "mlp_fc1_bias": False, "mlp_fc2_bias": False, "causal": False, "moe_every_n_layers": None}


def config_from_hf(config: Mapping[str, Any], name: str) -> NomicBertConfig:
    for key, supported in _REQUIRED.items():
        value = config.get(key)
        if value is not None and not (value == supported if supported is not None else not value):
            raise UnsupportedError(f"{name}: nomic-bert {key} {config[key]!r} is not supported ({supported!r})")
    activation = config.get("activation_function", config.get("hidden_act", "swiglu"))
    if activation not in ("swiglu", "silu"):
        raise UnsupportedError(f"{name}: nomic-bert activation {activation!r} is not supported (swiglu)")

    def first(*keys: str, default: Any = None) -> Any:
        return next((config[key] for key in keys if config.get(key) is not None), default)

    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedError(f"{name}: nomic-bert rope_type {rope['rope_type']!r} is not supported (default)")
    hidden_size = first("hidden_size", "n_embd")
    return NomicBertConfig(
        name=name, num_layers=first("num_hidden_layers", "n_layer"), hidden_size=hidden_size,
        intermediate_size=first("intermediate_size", "n_inner", default=4 * hidden_size),
        num_heads=first("num_attention_heads", "n_head"),
        # The length it was trained on, as llama.cpp's converter keeps it, not the stretched n_positions.
        max_positions=first("max_trained_positions", "max_position_embeddings", "n_positions"),
        layer_norm_eps=first("layer_norm_eps", "layer_norm_epsilon", default=1e-12), vocab_size=config["vocab_size"],
        rope_theta=float(rope.get("rope_theta") or first("rotary_emb_base", default=DEFAULT_ROPE_THETA)))


_HF_LAYER_NAMES = {"attn.Wqkv": "attn_qkv", "attn.out_proj": "attn_output", "norm1": "attn_output_norm",
                   "mlp.fc11": "ffn_up", "mlp.fc12": "ffn_gate", "mlp.fc2": "ffn_down", "norm2": "layer_output_norm"}
_HF_TOP_NAMES = {"embeddings.word_embeddings": "token_embd", "embeddings.token_type_embeddings": "token_types",
                 "emb_ln": "token_embd_norm"}


def hf_name_to_gguf(name: str) -> str | None:
    """A nomic-bert checkpoint's tensor name -> llama.cpp's."""
    stem, _, kind = name.removeprefix("bert.").rpartition(".")
    return f"{gguf_tensor_name(stem, _HF_TOP_NAMES, 'encoder.layers.', _HF_LAYER_NAMES, 'nomic-bert')}.{kind}"


class NomicBertLayer:
    def __init__(self, weights: dict, prefix: str, weight_format: str, device: torch.device):
        def linear(*names: str, role: str):
            return make_linear(concat_rows([weights.pop(f"{prefix}.{name}.weight") for name in names]), None,
                               weight_format, device, role in bert.PRECISE_PROJECTIONS)

        def norm(name: str) -> tuple[torch.Tensor, torch.Tensor]:
            return tuple(as_dense(weights.pop(f"{prefix}.{name}.{kind}")).float().to(device)
                         for kind in ("weight", "bias"))

        self.qkv = linear("attn_qkv", role="qkv")  # nomic's Wqkv, as llama.cpp's converter writes it
        self.out = linear("attn_output", role="out")
        self.attention_norm = norm("attn_output_norm")
        self.gate_up = linear("ffn_gate", "ffn_up", role="up")
        self.down = linear("ffn_down", role="down")
        self.output_norm = norm("layer_output_norm")


class NomicBertModel(bert.BertModel):
    def __init__(self, config: NomicBertConfig, weights: dict, weight_format: str, device: torch.device):
        self.config = config
        self.device = device
        self.token_embedding = EmbeddingTable(weights.pop("token_embd.weight"), torch.float32, device)
        types = weights.pop("token_types.weight", None)
        self.type_embedding = None if types is None else as_dense(types).float().to(device)
        self.embedding_norm = tuple(as_dense(weights.pop(f"token_embd_norm.{kind}")).float().to(device)
                                    for kind in ("weight", "bias"))
        self.rotary = rotary_embedding(config.head_dim, config.rope_theta, config.max_positions, device)
        self.layers = [NomicBertLayer(weights, f"blk.{index}", weight_format, device)
                       for index in range(config.num_layers)]

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """-> final hidden states [num_tokens, hidden] float32."""
        config = self.config
        hidden = self.token_embedding(batch.input_ids).float()
        if self.type_embedding is not None:
            hidden = hidden + self.type_embedding[batch.token_type_ids]
        hidden = self._norm(hidden, self.embedding_norm)
        cos, sin = self.rotary.tables(batch.positions)
        shape = (-1, config.num_heads, config.head_dim)
        for layer in self.layers:
            query, key, value = layer.qkv(hidden).split(config.hidden_size, dim=-1)
            # Rotated in float32 (the tables' precision), attended in the projections' dtype.
            query = self.rotary.apply(query.reshape(shape).float(), cos, sin).to(value.dtype)
            key = self.rotary.apply(key.reshape(shape).float(), cos, sin).to(value.dtype)
            attended = packed_attention(query, key, value.reshape(shape), batch)
            hidden = self._norm(hidden + layer.out(attended), layer.attention_norm)
            gate, up = layer.gate_up(hidden).chunk(2, dim=-1)
            hidden = self._norm(hidden + layer.down(F.silu(gate) * up), layer.output_norm)
        return hidden


Model = NomicBertModel
