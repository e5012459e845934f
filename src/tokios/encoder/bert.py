"""BERT (BERT, MiniLM, bge, and BertForSequenceClassification cross-encoders).

Absolute learned positions plus token-type embeddings, LayerNorm after each sublayer (post-norm),
biased projections, exact-erf GELU; no final norm. Weights go by llama.cpp's GGUF names; a
Hugging Face checkpoint's are renamed (HF_NAMES), with or without the "bert." prefix that task
heads add. The classifier of a sequence-classification checkpoint is `cls.output`; its pooler
(dense + tanh on the first token) is `cls` where the file keeps it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from tokios.encoder.attention import packed_attention
from tokios.encoder.batch import EncoderBatch
from tokios.encoder.names import gguf_tensor_name
from tokios.errors import UnsupportedError
from tokios.model.linear import make_linear
from tokios.model.quant import EmbeddingTable, as_dense, concat_rows


@dataclass(frozen=True)
class BertConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    max_positions: int
    layer_norm_eps: float
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def config_from_gguf(metadata: Mapping[str, Any], architecture: str, name: str) -> BertConfig:
    return BertConfig(name=name, num_layers=int(metadata[f"{architecture}.block_count"]),
                      hidden_size=int(metadata[f"{architecture}.embedding_length"]),
                      intermediate_size=int(metadata[f"{architecture}.feed_forward_length"]),
                      num_heads=int(metadata[f"{architecture}.attention.head_count"]),
                      max_positions=int(metadata[f"{architecture}.context_length"]),
                      layer_norm_eps=float(metadata[f"{architecture}.attention.layer_norm_epsilon"]),
                      vocab_size=len(metadata["tokenizer.ggml.tokens"]))


def config_from_hf(config: Mapping[str, Any], name: str) -> BertConfig:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedError(f"{name}: BERT position_embedding_type {config['position_embedding_type']!r} is not "
                               "supported (absolute)")
    if config.get("hidden_act", "gelu") != "gelu":
        raise UnsupportedError(f"{name}: BERT hidden_act {config['hidden_act']!r} is not supported (gelu)")
    return BertConfig(name=name, num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
                      intermediate_size=config["intermediate_size"], num_heads=config["num_attention_heads"],
                      max_positions=config["max_position_embeddings"], layer_norm_eps=config["layer_norm_eps"],
                      vocab_size=config["vocab_size"])


_HF_LAYER_NAMES = {"attention.self.query": "attn_q", "attention.self.key": "attn_k",
                   "attention.self.value": "attn_v", "attention.output.dense": "attn_output",
                   "attention.output.LayerNorm": "attn_output_norm", "intermediate.dense": "ffn_up",
                   "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
_HF_TOP_NAMES = {"embeddings.word_embeddings": "token_embd", "embeddings.position_embeddings": "position_embd",
                 "embeddings.token_type_embeddings": "token_types", "embeddings.LayerNorm": "token_embd_norm",
                 "pooler.dense": "cls", "classifier": "cls.output"}
# Not used by an encoder: position ids, and a masked-LM / next-sentence head.
_HF_UNUSED = re.compile(r"^(embeddings\.position_ids|cls\.(predictions|seq_relationship)\..*)$")


def hf_name_to_gguf(name: str) -> str | None:
    """A Hugging Face BERT tensor name -> llama.cpp's; None for tensors an encoder does not use."""
    name = name.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
    if _HF_UNUSED.match(name):
        return None
    stem, _, kind = name.rpartition(".")
    return f"{gguf_tensor_name(stem, _HF_TOP_NAMES, 'encoder.layer.', _HF_LAYER_NAMES, 'BERT')}.{kind}"


# The projections of a quantized encoder that take precise (~15-bit) activations on the kernels
# (model/kernels precise_activations): the attention's q, k and v, whose errors the softmax
# amplifies, and the feed-forward's up projection (its errors go through the GELU); the output
# and down projections take 8-bit ones, as llama.cpp's quantized products do. all-MiniLM-L6-v2
# Q8_0 against sentence-transformers, on tests/model/test_minilm.py's texts (near-empty ones are
# the hardest): 8-bit everywhere gave cosine min 0.9988 (llama.cpp's own: 0.9988), precise q/k/v
# 0.9989, precise q/k/v and up 0.9993 at 1.17x the speed of precise everywhere (0.9996).
PRECISE_PROJECTIONS = frozenset({"qkv", "up"})


class BertLayer:
    def __init__(self, weights: dict, prefix: str, weight_format: str, device: torch.device):
        def dense(name: str) -> torch.Tensor:
            return as_dense(weights.pop(f"{prefix}.{name}")).float().to(device)

        names = ("attn_q", "attn_k", "attn_v")
        self.qkv = make_linear(concat_rows([weights.pop(f"{prefix}.{n}.weight") for n in names]),
                               torch.cat([dense(f"{n}.bias") for n in names]), weight_format, device,
                               "qkv" in PRECISE_PROJECTIONS)
        self.out = make_linear(weights.pop(f"{prefix}.attn_output.weight"), dense("attn_output.bias"),
                               weight_format, device, "out" in PRECISE_PROJECTIONS)
        self.attention_norm = (dense("attn_output_norm.weight"), dense("attn_output_norm.bias"))
        self.up = make_linear(weights.pop(f"{prefix}.ffn_up.weight"), dense("ffn_up.bias"), weight_format, device,
                              "up" in PRECISE_PROJECTIONS)
        self.down = make_linear(weights.pop(f"{prefix}.ffn_down.weight"), dense("ffn_down.bias"), weight_format,
                                device, "down" in PRECISE_PROJECTIONS)
        self.output_norm = (dense("layer_output_norm.weight"), dense("layer_output_norm.bias"))


class BertModel:
    def __init__(self, config: BertConfig, weights: dict, weight_format: str, device: torch.device):
        self.config = config
        self.device = device
        self.token_embedding = EmbeddingTable(weights.pop("token_embd.weight"), torch.float32, device)
        self.position_embedding = as_dense(weights.pop("position_embd.weight")).float().to(device)
        types = weights.pop("token_types.weight", None)
        self.type_embedding = None if types is None else as_dense(types).float().to(device)
        self.embedding_norm = (as_dense(weights.pop("token_embd_norm.weight")).float().to(device),
                               as_dense(weights.pop("token_embd_norm.bias")).float().to(device))
        self.layers = [BertLayer(weights, f"blk.{index}", weight_format, device) for index in range(config.num_layers)]

    def _norm(self, x: torch.Tensor, weight_bias: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (self.config.hidden_size,), *weight_bias, eps=self.config.layer_norm_eps)

    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """-> final hidden states [num_tokens, hidden] float32."""
        config = self.config
        hidden = self.token_embedding(batch.input_ids).float() + self.position_embedding[batch.positions]
        if self.type_embedding is not None:
            hidden = hidden + self.type_embedding[batch.token_type_ids]
        hidden = self._norm(hidden, self.embedding_norm)
        shape = (-1, config.num_heads, config.head_dim)
        for layer in self.layers:
            query, key, value = layer.qkv(hidden).split(config.hidden_size, dim=-1)
            attended = packed_attention(query.reshape(shape), key.reshape(shape), value.reshape(shape), batch)
            hidden = self._norm(hidden + layer.out(attended), layer.attention_norm)
            hidden = self._norm(hidden + layer.down(F.gelu(layer.up(hidden))), layer.output_norm)
        return hidden


Model = BertModel
