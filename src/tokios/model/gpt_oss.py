"""gpt-oss (OpenAI's mixture of experts; GGUF architecture `gpt-oss`) as one forward pass.

Where it differs from Llama (model/llama.py), all read from the file:
- attention: biases on q, k, v and o; attention sinks, one learned logit per query head that
  joins the softmax's denominator (ops.attention's `sinks`); even layers attend through a
  sliding window, odd ones fully (config.layer_windows, model/gpt_oss_metadata.py: each layer
  reads its KV group's metadata); YaRN RoPE without rounding its correction range
  (model/rope.py, model/shape.py); RoPE in rotate-half order (the converter does not permute).
- feed-forward: the shared sparse MoE (model/moe.py make_sparse_moe) with a biased router, the
  top k of the router logits softmaxed among themselves ("top_k_softmax", model/shape.py's rule
  for gpt-oss), experts with biases and the clamped SwiGLU ("swiglu_oai", alpha 1.702, limit 7.0).
The norms are Llama's two RMSNorms per layer (the file's attn_norm and post_attention_norm).

Expert weights arrive as model/moe.py's docstring lays them out (a GGUF file's stacked
`ffn_*_exps`; MXFP4 ones run on the kernels as stored); a Hugging Face directory's fused,
interleaved `gate_up_proj` is split into that layout by model/expert_weights.py. The fused
decode step takes the sinks and the packed experts.
"""

from __future__ import annotations

import torch

from tokios.config import ModelConfig
from tokios.model.gpt_oss_metadata import SWIGLU_ALPHA, SWIGLU_LIMIT
from tokios.model.llama import LlamaLayer, LlamaModel
from tokios.model.moe import ExpertActivation
from tokios.model.quant import as_dense

ACTIVATION = ExpertActivation("swiglu_oai", alpha=SWIGLU_ALPHA, limit=SWIGLU_LIMIT)


class GptOssLayer(LlamaLayer):
    expert_activation = ACTIVATION

    def __init__(self, config: ModelConfig, weights: dict, prefix: str, weight_format: str, device: torch.device,
                 ops=None):
        super().__init__(config, weights, prefix, weight_format, device, ops)
        # Float32 whatever the activations, as the attention's scores are.
        self.sinks = as_dense(weights.pop(f"{prefix}.self_attn.sinks")).to(device=device,
                                                                           dtype=torch.float32).contiguous()


class GptOssModel(LlamaModel):
    layer_class = GptOssLayer
