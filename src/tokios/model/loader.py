"""Model loading: a GGUF file or a Hugging Face directory -> ModelConfig + model + tokenizer source.

The file's shape is read by model/shape.py (ModelShape), and ModelConfig is made from it here.
Both paths produce weights in Hugging Face names and layout, so one model file per
architecture serves both. The architecture registry maps the file's architecture name to that
model class; anything else is an UnsupportedError naming it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from gguf import GGMLQuantizationType

from tokios import load_progress
from tokios.config import ModelConfig
from tokios.errors import ModelLoadError, UnsupportedError
from tokios.gguf_file import GGUFFile
from tokios.model.decoder import ModelPart
from tokios.model.expert_weights import gather_expert_weights
from tokios.model.gemma3 import Gemma3Model
from tokios.model.gemma4 import Gemma4Model
from tokios.model.gpt_oss import GptOssModel
from tokios.model.llama import LlamaModel
from tokios.model.olmoe import OlmoeModel
from tokios.model.phi3 import split_fused_projections
from tokios.model.qwen3 import Qwen3Model
from tokios.model.quant import PACKABLE_TYPES, PackedWeight, dequantize
from tokios.model.rope import pair_unrotated_dimensions
from tokios.model.shape import ModelShape, gguf_architecture, shape_from_gguf, shape_from_hf_directory

# GGUF architecture name / HF model_type -> model class. A llama file with expert tensors is
# Mixtral; the MoE architectures differ from their dense cousins only in the feed-forward
# (their routing rules: model/shape.py).
ARCHITECTURES = {"llama": LlamaModel, "mistral": LlamaModel, "qwen2": LlamaModel, "qwen3": Qwen3Model,
                 "phi3": LlamaModel, "gemma3": Gemma3Model, "gemma4": Gemma4Model,
                 "qwen3moe": Qwen3Model, "qwen2moe": LlamaModel, "olmoe": OlmoeModel, "gpt-oss": GptOssModel}
# The architectures whose mixture of experts tokios runs.
_MOE_ARCHITECTURES = ("llama", "qwen3moe", "qwen2moe", "olmoe", "gpt-oss", "gemma4")

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_HEAD_NORM_NAMES = {"attn_q_norm.weight": "self_attn.q_norm.weight",
                         "attn_k_norm.weight": "self_attn.k_norm.weight"}
# A mixture of experts' tensors (model/expert_weights.py: the merged gate_up is split there).
_GGUF_EXPERT_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
    "ffn_gate_up_exps.weight": "mlp.experts.gate_up_proj.weight",
}
_GGUF_SHARED_EXPERT_NAMES = {
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# Gemma's four norms per layer: attn_norm and ffn_norm are the pre-norms; llama.cpp's converter
# stores every Gemma norm weight as (1 + w), so they multiply as stored.
GGUF_LAYER_NAMES_BY_ARCHITECTURE = {
    "gemma3": {**_GGUF_LAYER_NAMES, **_GGUF_HEAD_NORM_NAMES,
               "ffn_norm.weight": "pre_feedforward_layernorm.weight",
               "post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"},
    "qwen3": {**_GGUF_LAYER_NAMES, **_GGUF_HEAD_NORM_NAMES},
    "llama": {**_GGUF_LAYER_NAMES, **_GGUF_EXPERT_NAMES},  # Mixtral
    "qwen3moe": {**_GGUF_LAYER_NAMES, **_GGUF_HEAD_NORM_NAMES, **_GGUF_EXPERT_NAMES},
    "qwen2moe": {**_GGUF_LAYER_NAMES, **_GGUF_EXPERT_NAMES, **_GGUF_SHARED_EXPERT_NAMES},
    # OLMoE's q/k norms span the whole projection (model/olmoe.py), under the same names.
    "olmoe": {**_GGUF_LAYER_NAMES, **_GGUF_HEAD_NORM_NAMES, **_GGUF_EXPERT_NAMES},
    # Phi-3 keeps its fused projections: attn_qkv is q, k, v stacked; ffn_up is gate then up.
    "phi3": {**_GGUF_LAYER_NAMES,
             "attn_qkv.weight": "self_attn.qkv_proj.weight",
             "ffn_up.weight": "mlp.gate_up_proj.weight"},
}
# Gemma 4 (converter: conversion/gemma.py Gemma4Model) adds the per-layer input embedding's
# gate, projection and norm, and a scalar on each layer's output; its norms are stored as is.
GGUF_LAYER_NAMES_BY_ARCHITECTURE["gemma4"] = {
    **GGUF_LAYER_NAMES_BY_ARCHITECTURE["gemma3"],
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
    "layer_output_scale.weight": "layer_scalar",
    # the MoE variant: the router's scale, the per-expert output scale, the experts' own norms
    **_GGUF_EXPERT_NAMES,
    "ffn_gate_inp.scale": "mlp.gate.scale", "ffn_down_exps.scale": "mlp.experts.down_proj.scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight"}
# gpt-oss (converter: conversion/gpt_oss.py): biases on the attention output, the sinks, the
# norm before the experts (llama.cpp's attn_post_norm), the biased router and experts.
GGUF_LAYER_NAMES_BY_ARCHITECTURE["gpt-oss"] = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp.bias": "mlp.gate.bias",
    **{f"ffn_{kind}_exps.{part}": f"mlp.experts.{kind}_proj.{part}"
       for kind in ("gate", "up", "down") for part in ("weight", "bias")}}
# Architectures whose converter keeps Q/K rows in the Hugging Face (NEOX, rotate-half) order:
# llama.cpp's convert_hf_to_gguf.py interleaves the rows only for the Llama family (llama, mistral).
_UNPERMUTED_ROPE_ARCHITECTURES = ("gemma3", "gemma4", "qwen2", "qwen3", "phi3", "qwen2moe", "qwen3moe", "olmoe",
                                  "gpt-oss")

_GGUF_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight",
                   "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                   "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
                   "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
# Model-wide RoPE tensors -> the names read_model_file folds into config.rope_scaling.
_GGUF_ROPE_NAMES = {"rope_freqs.weight": "rope_freqs", "rope_factors_long.weight": "rope_factors_long",
                    "rope_factors_short.weight": "rope_factors_short"}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: Any
    tokenizer_source: Any  # GGUF metadata dict, or the HF directory path
    load_seconds: float
    path: str


def _architecture_class(name: str):
    if name not in ARCHITECTURES:
        raise UnsupportedError(f"model architecture {name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[name]


def model_config_from_shape(shape: ModelShape) -> ModelConfig:
    """The engine's ModelConfig: the file's shape under the names the model code reads."""
    if shape.num_rope_dims is not None and not (0 < shape.num_rope_dims < shape.head_dim
                                                and shape.num_rope_dims % 2 == 0):
        raise ModelLoadError(f"{shape.name}: RoPE on {shape.num_rope_dims} of each head's {shape.head_dim} "
                             "dimensions (an even number below it is needed)")
    if shape.is_moe and shape.architecture not in _MOE_ARCHITECTURES:
        raise UnsupportedError(f"{shape.name}: a mixture of experts in architecture {shape.architecture!r} is not "
                               f"supported (supported: {', '.join(_MOE_ARCHITECTURES)})")
    return ModelConfig(
        architecture=shape.architecture,
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        vocab_size=shape.vocab_size,
        max_model_len=shape.max_context_len,
        rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling,
        rms_norm_eps=shape.rms_norm_eps,
        num_rope_dims=shape.num_rope_dims,
        tie_word_embeddings=shape.tie_word_embeddings,
        attention_bias=shape.has_qkv_bias,
        name=shape.name,
        layer_windows=shape.layer_windows,
        rope_local_theta=shape.rope_local_theta,
        query_pre_attn_scalar=shape.query_pre_attn_scalar,
        final_logit_softcapping=shape.final_logit_softcapping,
        layer_kv_shapes=shape.layer_kv_shapes,
        kv_source_layers=shape.kv_source_layers,
        num_experts=shape.num_experts,
        num_experts_per_token=shape.num_experts_per_token,
        expert_intermediate_size=shape.expert_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        expert_scoring=shape.expert_scoring,
        expert_normalize_top_k=shape.expert_normalize_top_k,
        expert_weights_scale=shape.expert_weights_scale,
    )


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    # The architecture first: an unsupported one is named, not its first missing key.
    _architecture_class(gguf_architecture(gguf.metadata, gguf.path))
    return model_config_from_shape(shape_from_gguf(gguf))


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    # llama.cpp's converter interleaves each head's two rotary halves; restore HF's layout.
    out_features = weight.shape[0]
    rest = weight.shape[1:]
    return weight.reshape(num_heads, out_features // num_heads // 2, 2, *rest).transpose(1, 2).reshape(weight.shape)


def weights_from_gguf(gguf: GGUFFile, config: ModelConfig,
                      keep: Callable[[str], bool] | None = None) -> dict[str, "torch.Tensor | PackedWeight"]:
    """The file's tensors in Hugging Face names; with `keep`, only those whose name it accepts
    are read at all (a parallel rank reads its own layers, not the whole file)."""
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    layer_names = GGUF_LAYER_NAMES_BY_ARCHITECTURE.get(config.architecture, _GGUF_LAYER_NAMES)
    unpermute = config.architecture not in _UNPERMUTED_ROPE_ARCHITECTURES
    name_to_hf_name: dict[str, str] = {}
    for name in gguf.tensors:
        if name in _GGUF_TOP_NAMES:
            hf_name = _GGUF_TOP_NAMES[name]
        elif name.startswith("blk."):
            _, index, local = name.split(".", 2)
            if local not in layer_names:
                raise UnsupportedError(f"{gguf.path}: tensor {name} is not part of the {config.architecture} "
                                       "architecture as tokios implements it")
            hf_name = f"model.layers.{index}.{layer_names[local]}"
        elif name in _GGUF_ROPE_NAMES:
            hf_name = _GGUF_ROPE_NAMES[name]
        else:
            raise UnsupportedError(f"{gguf.path}: unexpected tensor {name}")
        if keep is None or keep(hf_name):
            name_to_hf_name[name] = hf_name
    total_bytes = sum(gguf.tensors[name].num_bytes for name in name_to_hf_name)
    with load_progress.phase("reading weights", total_bytes) as reading:
        for name, hf_name in name_to_hf_name.items():
            weight = read_gguf_tensor(gguf, name)
            reading.advance(gguf.tensors[name].num_bytes)
            rows = weight.raw if isinstance(weight, PackedWeight) else weight
            # The permutation moves whole output rows, so it applies to packed block rows as well.
            if not unpermute:
                pass
            elif hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                rows = _unpermute_rope(rows, config.num_heads)
            elif hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                rows = _unpermute_rope(rows, config.num_kv_heads)
            if isinstance(weight, PackedWeight) and rows is not weight.raw:
                weight = weight.with_rows(rows)
            weights[hf_name] = weight if isinstance(weight, PackedWeight) else rows
    return weights


def read_gguf_tensor(gguf: GGUFFile, name: str) -> "torch.Tensor | PackedWeight":
    """One tensor as the engine holds it: a matrix (or a mixture of experts' 3-D stack) of a
    type the kernels run stays in its blocks; anything else is dequantized (bfloat16 kept)."""
    info = gguf.tensors[name]
    if info.ggml_type in PACKABLE_TYPES and len(info.shape) in (2, 3):
        return PackedWeight.from_file(gguf.raw_bytes(name), info.ggml_type, info.shape, name)
    rows = dequantize(gguf.raw_bytes(name), info.ggml_type, info.shape, name)
    if info.ggml_type == GGMLQuantizationType.BF16:
        rows = rows.to(torch.bfloat16)  # exact; "stored" then multiplies in bfloat16
    return rows


def read_gguf_tensors(gguf: GGUFFile) -> dict[str, "torch.Tensor | PackedWeight"]:
    """Every tensor of the file under its GGUF name (an encoder's loader renames nothing)."""
    return {name: read_gguf_tensor(gguf, name) for name in gguf.tensors}


def model_config_from_hf(directory: str) -> ModelConfig:
    shape = shape_from_hf_directory(directory)
    _architecture_class(shape.architecture)
    if shape.rope_theta is None:
        raise UnsupportedError(f"{os.path.join(directory, 'config.json')}: rope_parameters without rope_theta "
                               f"(per layer type: {sorted(shape.rope_scaling or ())}) is not supported for this "
                               "architecture")
    return model_config_from_shape(shape)


def weights_from_hf(directory: str, keep: Callable[[str], bool] | None = None,
                    prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors by name (`prefix` put before each name, `keep` asked with it)."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    files = _safetensors_files(directory)
    # The files' sizes are the weights' (their JSON headers are small); a part reads fewer.
    total_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in files) if keep is None else None
    with load_progress.phase("reading weights", total_bytes) as reading:
        for file_name in files:
            with safe_open(os.path.join(directory, file_name), framework="pt") as handle:
                for name in handle.keys():
                    if keep is None or keep(prefix + name):
                        # its own dtype: --dtype auto multiplies bfloat16 weights in bfloat16
                        tensor = weights[prefix + name] = handle.get_tensor(name)
                        reading.advance(tensor.numel() * tensor.element_size())
    return weights


def _safetensors_files(directory: str) -> list[str]:
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{directory}: no *.safetensors weight files")
    return files


def _base_model_prefix(directory: str) -> str:
    """"model." when a causal LM's checkpoint holds its base model's tensors under their own
    names (Qwen3-Embedding: config.json names Qwen3ForCausalLM over Qwen3Model's `embed_tokens`,
    `layers.N...`, as sentence-transformers saves it), else ""."""
    from safetensors import safe_open

    names: set[str] = set()
    for file_name in _safetensors_files(directory):
        with safe_open(os.path.join(directory, file_name), framework="pt") as handle:
            names.update(handle.keys())
    is_base_model = "embed_tokens.weight" in names and not any(name.startswith("model.") for name in names)
    return "model." if is_base_model else ""


def read_model_file(path: str, part_of: Callable[[ModelConfig], ModelPart] | None = None,
                    context_len: int | None = None) -> tuple[ModelConfig, dict, Any]:
    """A GGUF file or HF directory -> (config, weights in Hugging Face names, tokenizer source).
    part_of: the part of the model (given its config) whose weights to read; None: all.
    context_len: the longest sequence the engine serves (its max_model_len), when shorter than
    the file's; the config's max_model_len becomes it (RoPE tables, LongRoPE's choice of table)."""
    if os.path.isdir(path):
        config = model_config_from_hf(path)
        keep = _weights_to_read(part_of, config)
        weights = weights_from_hf(path, keep, _base_model_prefix(path))
        tokenizer_source: Any = path
    else:
        with load_progress.phase("reading the file's metadata and vocabulary"):
            gguf = GGUFFile(path)
        config = model_config_from_gguf(gguf)
        keep = _weights_to_read(part_of, config)
        weights = weights_from_gguf(gguf, config, keep)
        tokenizer_source = gguf.metadata
    weights = gather_expert_weights(weights, config)
    weights = pair_unrotated_dimensions(split_fused_projections(weights, config), config)
    if context_len is not None and context_len < config.max_model_len:
        config = replace(config, max_model_len=context_len)
    if "rope_freqs" in weights:
        config = _with_rope_factors(config, weights.pop("rope_freqs"))
    if "rope_factors_long" in weights:
        config = replace(config, rope_scaling={**config.rope_scaling,
                                               "long_factor": weights.pop("rope_factors_long").tolist(),
                                               "short_factor": weights.pop("rope_factors_short").tolist()})
    if "lm_head.weight" in weights and config.tie_word_embeddings:
        weights.pop("lm_head.weight")
    return config, weights, tokenizer_source


def _weights_to_read(part_of, config: ModelConfig) -> Callable[[str], bool] | None:
    if part_of is None:
        return None
    part = part_of(config)
    return lambda name: part.needs(name, config.tie_word_embeddings)


def build_model(path: str, config: ModelConfig, weights: dict, weight_format: str, device: torch.device,
                part: ModelPart | None = None):
    """The architecture's model class over `weights` (all of them, or the part's)."""
    model_class = _architecture_class(config.architecture)
    try:
        return model_class(config, weights, weight_format, device, part)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: missing weight {exc.args[0]}") from None


def load_model(path: str, weight_format: str, device: torch.device, part: ModelPart | None = None,
               context_len: int | None = None) -> LoadedModel:
    """Load a GGUF file or HF directory into the model class of its architecture (all of it, or
    `part` of it: the front of a parallel group builds only the output head), for sequences of up
    to context_len tokens (None: the file's context)."""
    started = time.perf_counter()
    config, weights, tokenizer_source = read_model_file(path, None if part is None else (lambda _: part),
                                                        context_len)
    with load_progress.phase(f"building the model's {config.num_layers} layers"):
        model = build_model(path, config, weights, weight_format, device, part)
    return LoadedModel(config, model, tokenizer_source, time.perf_counter() - started, path)


def _with_rope_factors(config: ModelConfig, factors: torch.Tensor) -> ModelConfig:
    return replace(config, rope_scaling={"type": "freq_factors", "factors": factors})
