"""The one description of a model file: `ModelShape`, read once from a GGUF file or a Hugging Face
directory by `read_model_shape(path)` (or `shape_from_gguf` / `shape_from_hf_directory`).

A shape is what the file says: the architecture name, the dimensions, RoPE and norm constants,
what an architecture adds (Gemma 3's sliding windows, model/gemma3_metadata.py), and, from the
tensor headers, the bytes per block type and the bytes a decode step reads. The model loader
(model/loader.py) turns it into the engine's ModelConfig; `tokios plan`, roofline and simulate
(tools/plan/) size a deployment with it, and presets there are shapes written by hand; `bench
compare` sizes both servers' caches and the server (memory estimate, the Ollama dialect's model
facts) describes its files with it.

No torch here and no weights read: a GGUF header is walked by tokios/gguf_file.py in
milliseconds, a directory's safetensors by their JSON headers, so `tokios plan` stays instant.
The shape reader takes any architecture; which ones run is the loader's registry.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.gguf_file import GGUFFile
from tokios.model.gemma3_metadata import gemma3_fields
from tokios.model.gemma4_metadata import gemma4_fields, gemma4_hf_fields
from tokios.model.gpt_oss_metadata import gpt_oss_fields, gpt_oss_hf_fields

# GGUF architecture -> what its metadata adds to the common shape: fn(metadata, path, num_layers).
_ARCHITECTURE_FIELDS = {"gemma3": gemma3_fields, "gemma4": gemma4_fields, "gpt-oss": gpt_oss_fields}
# Hugging Face model_type -> what its config.json adds: fn(config, path); the architecture it runs as.
_HF_ARCHITECTURE_FIELDS = {"gemma4_text": gemma4_hf_fields, "gpt_oss": gpt_oss_hf_fields}
# Mixtral runs as llama, as llama.cpp's converter writes it.
_HF_TYPE_TO_ARCHITECTURE = {"gemma4_text": "gemma4", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
                            "mixtral": "llama", "gpt_oss": "gpt-oss"}
# Architectures whose YaRN does not round its correction range to whole dimensions (transformers'
# rope_parameters truncate: false; OpenAI's gpt-oss implementation). The converter writes no key
# for it, and llama.cpp rounds for every model.
_UNTRUNCATED_YARN_ARCHITECTURES = ("gpt-oss",)
# Tensors a step gathers rows from rather than reading whole (token embeddings, Gemma 4's
# per-layer input embeddings).
_GATHERED_TENSORS = ("token_embd.weight", "per_layer_token_embd.weight")

# Hugging Face class name -> model type, for a config.json that names only the class.
HF_ARCHITECTURE_TO_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3",
                           "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
                           "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
                           "GptOssForCausalLM": "gpt_oss"}
# transformers' LlamaConfig default, for a config.json without max_position_embeddings.
DEFAULT_HF_CONTEXT_LEN = 2048

_SAFETENSORS_DTYPE_TO_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1,
                               "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8, "I16": 2, "BOOL": 1}
_TORCH_DTYPE_TO_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer described by its file (or by a preset: no file, no bytes).

    `file_weight_bytes` is the exact size of the weights when they come from a file (GGUF or
    safetensors); presets leave it None and the plan computes bytes from `--weight-bits`.
    """

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_context_len: int
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False
    file_weight_bytes: int | None = None
    # Bytes of the weights that a decode step reads whole: every linear layer and the output
    # projection, but not the token embedding table (a step gathers only its rows) unless tied.
    file_step_weight_bytes: int | None = None
    file_weight_bits: float | None = None  # average bits per weight in the file
    # Per layer: its sliding window in tokens (the layer attends to the last `window` positions,
    # its own included), or None for full attention. None: every layer is full.
    layer_windows: tuple[int | None, ...] | None = None
    architecture: str = "llama"  # GGUF general.architecture / HF model_type
    # None: the file gives a RoPE base per layer type (then rope_scaling holds those parameters).
    rope_theta: float | None = 10000.0
    rope_scaling: dict[str, Any] | None = dataclasses.field(default=None, hash=False)
    rms_norm_eps: float = 1e-5
    num_rope_dims: int | None = None  # leading dimensions of each head that RoPE rotates; None: all
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3), if it differs
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Per layer (KV heads, head_dim) where layers differ; None: all (num_kv_heads, head_dim).
    layer_kv_shapes: tuple[tuple[int, int], ...] | None = None
    # Per layer: the layer whose K/V it reads (itself unless it reuses an earlier one's); None: own.
    kv_source_layers: tuple[int, ...] | None = None
    # The file's bytes per block type (GGUF: Q4_K, Q6_K, F32, ...; safetensors: BF16, ...).
    block_type_to_num_bytes: dict[str, int] | None = dataclasses.field(default=None, hash=False)
    # Mixture of experts: every layer's feed-forward is num_experts routed experts of width
    # expert_intermediate_size, of which a token uses num_experts_per_token, plus (Qwen2-MoE) a
    # shared expert of width shared_expert_intermediate_size that every token uses. num_experts
    # 0: a dense feed-forward of intermediate_size.
    num_experts: int = 0
    num_experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # Bytes of the routed experts' tensors in the file (all of them; a step reads its tokens' share).
    file_expert_bytes: int | None = None
    # Gemma 4's MoE variant: a dense feed-forward of intermediate_size beside the experts.
    has_mlp_beside_experts: bool = False
    # The routing (model/moe.py Routing) as the file states it (GGUF expert_gating_func,
    # expert_weights_norm, expert_weights_scale; HF scoring_func, norm_topk_prob,
    # routed_scaling_factor), and where it is silent the architecture's rule.
    expert_scoring: str = "softmax"
    expert_normalize_top_k: bool = False
    expert_weights_scale: float = 1.0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_layer_linear_params(self) -> int:
        """Parameters of the matrices in all decoder layers (q, k, v, o, and the feed-forward:
        gate, up, down; of a mixture of experts, every expert's, the router's and the shared
        expert's)."""
        return self._layer_linear_params(self.num_experts)

    @property
    def num_active_layer_linear_params(self) -> int:
        """The layer parameters one token multiplies by: a mixture of experts' routed experts
        count num_experts_per_token of num_experts (a dense model: all of them)."""
        return self._layer_linear_params(self.num_experts_per_token)

    @property
    def num_routed_expert_params(self) -> int:
        """Parameters of every routed expert of every layer (0 for a dense model): what must be
        resident though a token multiplies by only num_experts_per_token of num_experts."""
        return self.num_layers * 3 * self.hidden_size * self.expert_intermediate_size * self.num_experts

    def _layer_linear_params(self, num_experts: int) -> int:
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.is_moe:
            shared = 3 * self.hidden_size * self.shared_expert_intermediate_size
            shared_gate = self.hidden_size if self.shared_expert_intermediate_size else 0
            router = self.hidden_size * self.num_experts
            mlp = 3 * self.hidden_size * self.expert_intermediate_size * num_experts + router + shared + shared_gate
            if self.has_mlp_beside_experts:
                mlp += 3 * self.hidden_size * self.intermediate_size
        else:
            mlp = 3 * self.hidden_size * self.intermediate_size
        bias = (self.q_size + 2 * self.kv_size) if self.has_qkv_bias else 0
        return self.num_layers * (attention + mlp + bias)

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """All parameters: layers, norms, embedding, and the output projection when untied."""
        norms = (2 * self.num_layers + 1) * self.hidden_size
        output = 0 if self.tie_word_embeddings else self.num_embedding_params
        return self.num_layer_linear_params + norms + self.num_embedding_params + output

    @property
    def num_active_params(self) -> int:
        """All parameters less the routed experts a token does not use (a dense model: all of
        them); counted as num_params is, embedding included, as Qwen's "A3B" counts."""
        if not self.is_moe:
            return self.num_params
        return self.num_params - self.num_layer_linear_params + self.num_active_layer_linear_params

    @property
    def num_step_params(self) -> int:
        """Parameters a one-token decode step reads: the layer matrices (of a mixture of experts,
        the token's experts only) and the output projection."""
        return self.num_active_layer_linear_params + self.num_embedding_params


def read_model_shape(path: str | os.PathLike[str]) -> ModelShape:
    """The shape of a GGUF file or a Hugging Face model directory."""
    if os.path.isdir(path):
        return shape_from_hf_directory(path)
    return shape_from_gguf(GGUFFile(path))


# ---- GGUF ---------------------------------------------------------------------------------------

def gguf_architecture(metadata: dict[str, Any], path: str) -> str:
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: GGUF metadata has no general.architecture")
    return arch


def shape_from_gguf(gguf: GGUFFile) -> ModelShape:
    """Hyper-parameters from the metadata, tying, biases and bytes from the tensor infos."""
    metadata, path = gguf.metadata, gguf.path
    arch = gguf_architecture(metadata, path)

    def get(key: str, default: Any = None) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_layers = int(get("block_count"))
    tensors = list(gguf.tensors.values())
    vocab_size = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab_size and "token_embd.weight" in gguf.tensors:
        vocab_size = gguf.tensors["token_embd.weight"].shape[0]
    if not vocab_size:
        raise ModelLoadError(f"{path}: GGUF has neither {arch}.vocab_size, tokenizer.ggml.tokens "
                             "nor token_embd.weight")
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling_type not in (None, "none"):
        rope_scaling = {"type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0)),
                        "original_max_position_embeddings":
                            int(get("rope.scaling.original_context_length", get("context_length")))}
        if scaling_type == "yarn":
            rope_scaling.update(_gguf_yarn_parameters(metadata, arch, path))
            if arch in _UNTRUNCATED_YARN_ARCHITECTURES:
                rope_scaling["truncate"] = False
    elif "rope_factors_long.weight" in gguf.tensors:
        # LongRoPE as llama.cpp's converter writes it: no scaling type, the two factor tables as
        # tensors (the loader reads them), the attention factor computed at conversion.
        rope_scaling = {"type": "longrope",
                        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                        "attention_factor": float(get("rope.scaling.attn_factor", 1.0))}
    head_dim = int(get("attention.key_length", hidden_size // num_heads))
    is_tied = "output.weight" not in gguf.tensors
    total_bytes = sum(t.num_bytes for t in tensors)
    block_type_to_num_bytes: dict[str, int] = collections.Counter()
    for tensor in tensors:
        block_type_to_num_bytes[tensor.ggml_type.name] += tensor.num_bytes
    num_elements = sum(t.num_elements for t in tensors)
    num_experts = int(metadata.get(f"{arch}.expert_count") or 0)
    num_experts_per_token = int(metadata.get(f"{arch}.expert_used_count") or 0) if num_experts else 0
    expert_bytes = sum(t.num_bytes for t in tensors if _is_routed_expert_tensor(t.name))
    step_bytes = sum(t.num_bytes for t in tensors
                     if t.name not in _GATHERED_TENSORS or (t.name == "token_embd.weight" and is_tied))
    if num_experts:
        # A one-token step reads its k experts' share of every routed expert tensor.
        step_bytes -= expert_bytes - expert_bytes * num_experts_per_token // num_experts
    fields = dict(
        name=str(metadata.get("general.name") or Path(path).stem),
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        # A list: one per layer (Gemma 4's wider feed-forward on its K/V-reading layers).
        intermediate_size=_largest(get("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=_largest(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        vocab_size=int(vocab_size),
        max_context_len=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        num_rope_dims=_partial(int(get("rope.dimension_count", head_dim)), head_dim),
        tie_word_embeddings=is_tied,
        has_qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        file_weight_bytes=total_bytes,
        file_step_weight_bytes=step_bytes,
        file_weight_bits=8 * total_bytes / num_elements if num_elements else None,
        block_type_to_num_bytes=dict(block_type_to_num_bytes),
        num_experts=num_experts,
        num_experts_per_token=num_experts_per_token,
        # Mixtral's converter writes no expert width: its experts are feed_forward_length wide.
        expert_intermediate_size=(int(metadata.get(f"{arch}.expert_feed_forward_length")
                                      or _largest(get("feed_forward_length"))) if num_experts else 0),
        shared_expert_intermediate_size=int(metadata.get(f"{arch}.expert_shared_feed_forward_length") or 0),
        file_expert_bytes=expert_bytes if num_experts else None,
        **(_routing(arch, _gguf_routing(metadata, arch, path)) if num_experts else {}),
    )
    if arch in _ARCHITECTURE_FIELDS:
        fields.update(_ARCHITECTURE_FIELDS[arch](metadata, path, num_layers))
    return ModelShape(**fields)


# Whether an architecture renormalises its top-k expert weights when the file does not say:
# llama.cpp's build_moe_ffn norm_w in models/<arch>.cpp (its loader reads no key for qwen3moe,
# qwen2moe, olmoe or llama; transformers: Qwen3-MoE's released configs set norm_topk_prob,
# Qwen1.5/2-MoE's and OLMoE's do not, Mixtral, written as llama, always renormalises).
_ARCHITECTURE_TO_EXPERT_NORMALIZE_TOP_K = {"qwen3moe": True, "llama": True, "qwen2moe": False, "olmoe": False,
                                           "gemma4": True}
# An architecture's scoring where the file does not say: gpt-oss softmaxes the chosen k logits
# only (llama.cpp's SOFTMAX_WEIGHT); the others softmax over all experts.
_ARCHITECTURE_TO_EXPERT_SCORING = {"gpt-oss": "top_k_softmax"}


def _routing(architecture: str, stated: dict[str, Any]) -> dict[str, Any]:
    """The routing fields: what the file states (a None is silence), else the architecture's rule
    (the scoring above, else softmax over all experts; the renormalisation above, off for other
    architectures; unscaled)."""
    normalize = stated.get("expert_normalize_top_k")
    return dict(expert_scoring=stated.get("expert_scoring") or _ARCHITECTURE_TO_EXPERT_SCORING.get(architecture,
                                                                                                   "softmax"),
                expert_normalize_top_k=(_ARCHITECTURE_TO_EXPERT_NORMALIZE_TOP_K.get(architecture, False)
                                        if normalize is None else normalize),
                expert_weights_scale=stated.get("expert_weights_scale") or 1.0)


# llama.cpp's llama_expert_gating_func_type -> model/moe.py's scoring (SOFTMAX_WEIGHT: the
# softmax over the chosen k logits only).
_GGUF_GATING_FUNC_TO_SCORING = {1: "softmax", 2: "sigmoid", 3: "top_k_softmax"}


def _gguf_routing(metadata: dict[str, Any], arch: str, path: str) -> dict[str, Any]:
    """The routing keys the file has (absent ones stay None). An expert_weights_scale of 0 is
    llama.cpp's "none" (its build_moe_ffn scales only by a factor other than 0 and 1)."""
    fields: dict[str, Any] = {}
    gating = metadata.get(f"{arch}.expert_gating_func")
    if gating is not None:
        if int(gating) not in _GGUF_GATING_FUNC_TO_SCORING:
            raise UnsupportedError(f"{path}: {arch}.expert_gating_func {gating} is not supported (supported: "
                                   f"{', '.join(f'{k} ({v})' for k, v in _GGUF_GATING_FUNC_TO_SCORING.items())})")
        fields["expert_scoring"] = _GGUF_GATING_FUNC_TO_SCORING[int(gating)]
    if metadata.get(f"{arch}.expert_weights_norm") is not None:
        fields["expert_normalize_top_k"] = bool(metadata[f"{arch}.expert_weights_norm"])
    scale = metadata.get(f"{arch}.expert_weights_scale")
    if scale is not None and float(scale) != 0.0:
        fields["expert_weights_scale"] = float(scale)
    return fields


def _is_routed_expert_tensor(name: str) -> bool:
    """blk.N.ffn_{gate,up,down,gate_up}_exps (weights and biases): the experts' stacked tensors."""
    return name.startswith("blk.") and name.split(".")[2].endswith("_exps")


def _largest(value: Any) -> int:
    """A GGUF count that may be one per layer: the largest."""
    return int(max(value)) if isinstance(value, (list, tuple)) else int(value)


# What llama.cpp's converter writes of a YaRN config beyond its factor and original context,
# under transformers' names.
_GGUF_YARN_KEYS = {"rope.scaling.yarn_attn_factor": "attention_factor", "rope.scaling.yarn_beta_fast": "beta_fast",
                   "rope.scaling.yarn_beta_slow": "beta_slow"}


def _gguf_yarn_parameters(metadata: dict[str, Any], arch: str, path: str) -> dict[str, float]:
    """A YaRN file's optional parameters. An extrapolation factor other than 1 (transformers has
    none) and DeepSeek's log multiplier (its mscale_all_dim, without the mscale it goes with) are
    named as unsupported."""
    extrapolation = metadata.get(f"{arch}.rope.scaling.yarn_ext_factor")
    if extrapolation is not None and float(extrapolation) != 1.0:
        raise UnsupportedError(f"{path}: {arch}.rope.scaling.yarn_ext_factor {extrapolation} is not supported "
                               "(YaRN is implemented with extrapolation factor 1)")
    if metadata.get(f"{arch}.rope.scaling.yarn_log_multiplier") is not None:
        raise UnsupportedError(f"{path}: {arch}.rope.scaling.yarn_log_multiplier is not supported")
    return {name: float(metadata[f"{arch}.{key}"]) for key, name in _GGUF_YARN_KEYS.items()
            if metadata.get(f"{arch}.{key}") is not None}


# ---- Hugging Face directory ---------------------------------------------------------------------

def shape_from_hf_directory(directory: str | os.PathLike[str]) -> ModelShape:
    """config.json (the language model's part of a multimodal one) and the safetensors headers."""
    path = Path(directory)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (a Hugging Face model directory needs one)")
    outer = json.loads(config_path.read_text())
    hf = outer.get("text_config", outer)  # multimodal wrappers nest the language model
    architectures = outer.get("architectures") or []
    model_type = hf.get("model_type") or (HF_ARCHITECTURE_TO_TYPE.get(architectures[0]) if architectures else None)
    rope_theta, rope_scaling = _rope_from_hf(hf)
    if hf.get("use_sliding_window"):
        # Qwen2/Qwen3 configs carry this switch (off in every released model); llama.cpp's
        # converter drops it, and running it as full attention would be silently wrong.
        raise UnsupportedError(f"{config_path}: use_sliding_window is not supported for {model_type} "
                               "(sliding-window attention on some layers of a Qwen model)")
    try:
        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hidden_size // num_heads)
        partial_rotary_factor = float((hf.get("rope_parameters") or {}).get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        if rope_scaling and (rope_scaling.get("rope_type") or rope_scaling.get("type")) in ("longrope", "su"):
            rope_scaling = _longrope_from_hf(rope_scaling, hf)
        extra = (_HF_ARCHITECTURE_FIELDS[model_type](hf, str(config_path))
                 if model_type in _HF_ARCHITECTURE_FIELDS else {})
        fields = dict(
            name=path.name,
            architecture=_HF_TYPE_TO_ARCHITECTURE.get(model_type,
                                                      model_type or (architectures[0] if architectures else "")),
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            vocab_size=int(hf["vocab_size"]),
            max_context_len=int(hf.get("max_position_embeddings", DEFAULT_HF_CONTEXT_LEN)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            num_rope_dims=_partial(int(head_dim * partial_rotary_factor), head_dim),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2-MoE names its q/k/v biases qkv_bias
            has_qkv_bias=bool(hf["attention_bias"] if hf.get("attention_bias") is not None
                              else hf.get("qkv_bias", model_type == "qwen2")),
        )
        fields.update(_experts_from_hf(hf, str(config_path), fields["architecture"]))
        shape = ModelShape(**{**fields, **extra})
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: missing or malformed field {exc}") from exc
    block_type_to_num_bytes, embedding_bytes, expert_bytes = _safetensors_bytes(path)
    if not block_type_to_num_bytes:
        bits = _TORCH_DTYPE_TO_BITS.get(str(hf.get("torch_dtype", "bfloat16")), 16)
        return dataclasses.replace(shape, file_weight_bits=float(bits))
    total_bytes = sum(block_type_to_num_bytes.values())
    step_bytes = total_bytes if shape.tie_word_embeddings else total_bytes - embedding_bytes
    if shape.is_moe:
        step_bytes -= expert_bytes - expert_bytes * shape.num_experts_per_token // shape.num_experts
    return dataclasses.replace(shape, file_weight_bytes=total_bytes, file_step_weight_bytes=step_bytes,
                               file_weight_bits=8 * total_bytes / shape.num_params,
                               block_type_to_num_bytes=block_type_to_num_bytes,
                               file_expert_bytes=expert_bytes if shape.is_moe else None)


# transformers' switches for layers with a dense MLP among the MoE ones (Qwen2/3-MoE), and
# OLMoE's clamp of q, k and v: llama.cpp runs none of them, and neither does tokios.
_HF_UNSUPPORTED_MOE_SETTINGS = {"mlp_only_layers": (None, []), "decoder_sparse_step": (None, 1),
                                "clip_qkv": (None,)}
_HF_SCORINGS = ("softmax", "sigmoid")


def _experts_from_hf(hf: dict, config_path: str, architecture: str) -> dict[str, Any]:
    """A mixture of experts' counts, widths and routing under transformers' names (Qwen-MoE,
    OLMoE and Gemma 4 num_experts, Mixtral and gpt-oss num_local_experts; Gemma 4 top_k_experts
    for num_experts_per_tok; no moe_intermediate_size: the
    experts are intermediate_size wide; norm_topk_prob, scoring_func and routed_scaling_factor
    where the config has them). A setting tokios does not run is an error naming it."""
    num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not num_experts:
        return {}
    for key, allowed in _HF_UNSUPPORTED_MOE_SETTINGS.items():
        if hf.get(key) not in allowed:
            raise UnsupportedError(f"{config_path}: {key} {hf[key]!r} is not supported (a mixture of experts "
                                   f"runs with {' or '.join(map(repr, allowed))})")
    scoring = hf.get("scoring_func")
    if scoring is not None and scoring not in _HF_SCORINGS:
        raise UnsupportedError(f"{config_path}: scoring_func {scoring!r} is not supported "
                               f"(supported: {', '.join(_HF_SCORINGS)})")
    normalize = hf.get("norm_topk_prob")
    scale = hf.get("routed_scaling_factor")
    return dict(num_experts=num_experts,
                num_experts_per_token=int(hf.get("num_experts_per_tok") or hf.get("top_k_experts")
                                          or hf["num_experts_per_token"]),
                expert_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
                shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
                **_routing(architecture, dict(expert_scoring=scoring,
                                              expert_normalize_top_k=None if normalize is None else bool(normalize),
                                              expert_weights_scale=None if scale is None else float(scale))))


def _rope_from_hf(hf: dict) -> tuple[float | None, dict | None]:
    """RoPE base and scaling from a config.json: transformers before 5 writes `rope_theta` and
    `rope_scaling`, 5 and later one `rope_parameters` holding both (read only the old keys, a
    directory saved by today's transformers would silently run at the default base). Parameters
    per layer type (no base of their own) come back as (None, those parameters)."""
    parameters = hf.get("rope_parameters")
    if parameters is None:
        return float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")
    if "rope_theta" not in parameters:
        return None, parameters
    scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    return float(parameters["rope_theta"]), (None if scaling.get("rope_type", "default") == "default" else scaling)


def _partial(num_rope_dims: int, head_dim: int) -> int | None:
    return None if num_rope_dims == head_dim else num_rope_dims


def _longrope_from_hf(scaling: dict, hf: dict) -> dict:
    """LongRoPE's parameters from a config.json, with what transformers derives when they are
    absent: original_max_position_embeddings from the config's top level (Phi-3's own place for
    it), and the attention factor sqrt(1 + ln(factor) / ln(original)) where factor, if not given,
    is max_position_embeddings / original_max_position_embeddings. (llama.cpp's converter
    always derives both factors so, ignoring a `factor` or `attention_factor` the config gives.)"""
    original = int(scaling.get("original_max_position_embeddings") or hf["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        factor = float(scaling.get("factor") or int(hf["max_position_embeddings"]) / original)
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {"type": "longrope", "long_factor": [float(f) for f in scaling["long_factor"]],
            "short_factor": [float(f) for f in scaling["short_factor"]],
            "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def _safetensors_bytes(path: Path) -> tuple[dict[str, int], int, int]:
    """(bytes per dtype, bytes of the token embedding, bytes of the routed experts) from the
    safetensors headers; no files: ({}, 0, 0)."""
    dtype_to_num_bytes: dict[str, int] = collections.Counter()
    embedding = experts = 0
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            header_len = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            num_elements = 1
            for dim in info["shape"]:
                num_elements *= int(dim)
            num_bytes = num_elements * _SAFETENSORS_DTYPE_TO_BYTES.get(info["dtype"], 2)
            dtype_to_num_bytes[info["dtype"]] += num_bytes
            if name.endswith("embed_tokens.weight"):
                embedding += num_bytes
            elif ".mlp.experts." in name:  # per expert (experts.7.up_proj) or stacked (experts.gate_up_proj)
                experts += num_bytes
    return dict(dtype_to_num_bytes), embedding, experts

