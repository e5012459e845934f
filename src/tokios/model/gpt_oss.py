"""gpt-oss (OpenAI's mixture of experts; GGUF architecture `gpt-oss`) as one forward pass.

Where it differs from Llama (model/llama.py), all read from the file:
- attention: biases on q, k, v and o; attention sinks, one learned logit per query head that
  joins the softmax's denominator (ops.attention's `sinks`); even layers attend through a
  sliding window, odd ones fully (config.layer_windows, model/gpt_oss_metadata.py: each layer
  reads its KV group's metadata); YaRN RoPE without rounding its correction range
  (model/rope.py, model/shape.py); RoPE in rotate-half order (the converter does not permute).
- feed-forward: model/moe.py's SparseMoE with a biased router, the top k of the router logits
  softmaxed among themselves ("top_k_softmax"), experts with biases and the clamped SwiGLU
  ("swiglu_oai", alpha 1.702, limit 7.0).
The norms are Llama's two RMSNorms per layer (the file's attn_norm and post_attention_norm).

Expert weights arrive as model/moe.py's docstring lays them out (a GGUF file's stacked
`ffn_*_exps`; MXFP4 ones run on the kernels as stored); a Hugging Face directory's fused,
interleaved `gate_up_proj` is split into that layout by `split_checkpoint_experts`. The fused
decode step takes the sinks and the packed experts.
"""

from __future__ import annotations

import torch

from tokios.config import ModelConfig
from tokios.model.attention import AttentionMetadata
from tokios.model.dtypes import ACTIVATION_DTYPE
from tokios.model.gpt_oss_metadata import SWIGLU_ALPHA, SWIGLU_LIMIT
from tokios.model.kernels import precise_activations
from tokios.model.linear import make_linear
from tokios.model.llama import LlamaModel
from tokios.model.moe import ExpertActivation, Routing, make_sparse_moe
from tokios.model.quant import as_dense, concat_rows

ACTIVATION = ExpertActivation("swiglu_oai", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)


class GptOssLayer:
    def __init__(self, config: ModelConfig, weights: dict, prefix: str, weight_format: str, device: torch.device,
                 ops=None):
        def weight(name: str):
            return weights.pop(f"{prefix}.{name}")

        dtype = ACTIVATION_DTYPE[weight_format]
        precise = precise_activations(weight_format)

        def dense(name: str, dtype: torch.dtype = dtype) -> torch.Tensor:
            return as_dense(weight(name)).to(device=device, dtype=dtype)

        self.input_norm = dense("input_layernorm.weight")
        self.post_attention_norm = dense("post_attention_layernorm.weight")
        qkv = concat_rows([weight(f"self_attn.{n}_proj.weight") for n in "qkv"])
        qkv_bias = torch.cat([as_dense(weight(f"self_attn.{n}_proj.bias")) for n in "qkv"])
        self.qkv = make_linear(qkv, qkv_bias, weight_format, device, precise)
        self.o_proj = make_linear(weight("self_attn.o_proj.weight"), as_dense(weight("self_attn.o_proj.bias")),
                                  weight_format, device, precise)
        # Float32 whatever the activations, as the attention's scores are.
        self.sinks = dense("self_attn.sinks", torch.float32).contiguous()  # [num_heads]
        self.feed_forward = make_sparse_moe(
            config, weights, prefix, Routing(config.num_experts, config.num_experts_per_token, scoring="top_k_softmax"),
            ACTIVATION, weight_format, device, dtype)


class GptOssModel(LlamaModel):
    layer_class = GptOssLayer

    def layer_loop(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]], count: int, start: int = 0) -> torch.Tensor:
        ops = self.ops
        rope_tables = ops.rope_tables(positions)
        for index, layer, (key_cache, value_cache) in zip(self.layer_indices[start:count], self.layers[start:count],
                                                          kv_caches[start:count]):
            qkv = self.project_qkv(layer, hidden)
            attended = ops.attention(qkv, positions, key_cache, value_cache, metadata.for_layer(index), rope_tables,
                                     sinks=layer.sinks)
            hidden = hidden + layer.o_proj(attended.to(self.dtype)).to(self.dtype)
            hidden = hidden + layer.feed_forward(ops.rms_norm(hidden, layer.post_attention_norm)).to(self.dtype)
        return hidden



def split_checkpoint_experts(weights: dict, config: ModelConfig) -> dict:
    """A gpt-oss Hugging Face checkpoint's feed-forward in the names and layout of a GGUF file
    (model/moe.py): router -> mlp.gate; experts.gate_up_proj [E, hidden, 2I] with gate and up
    interleaved along its last dimension (gate the even columns) -> gate_proj, up_proj
    [E, I, hidden]; down_proj [E, I, hidden] -> [E, hidden, I]; the biases likewise. Other
    architectures' weights, and those already so, pass unchanged."""
    if config.architecture != "gpt-oss":
        return weights
    renamed = {}
    for name, tensor in weights.items():
        if ".mlp.router." in name:
            renamed[name.replace(".mlp.router.", ".mlp.gate.")] = tensor
        elif name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[:-len("gate_up_proj")]
            renamed[f"{prefix}gate_proj.weight"] = tensor[..., ::2].transpose(1, 2).contiguous()
            renamed[f"{prefix}up_proj.weight"] = tensor[..., 1::2].transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.gate_up_proj_bias"):
            prefix = name[:-len("gate_up_proj_bias")]
            renamed[f"{prefix}gate_proj.bias"] = tensor[..., ::2].contiguous()
            renamed[f"{prefix}up_proj.bias"] = tensor[..., 1::2].contiguous()
        elif name.endswith(".mlp.experts.down_proj"):
            renamed[f"{name}.weight"] = tensor.transpose(1, 2).contiguous()
        elif name.endswith(".mlp.experts.down_proj_bias"):
            renamed[name.replace("down_proj_bias", "down_proj.bias")] = tensor
        else:
            renamed[name] = tensor
    return renamed
