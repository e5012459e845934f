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
import os
from pathlib import Path
from typing import Any

from tokios.errors import ModelLoadError, UnsupportedError
from tokios.gguf_file import GGUFFile
from tokios.model.gemma3_metadata import gemma3_fields

# Hugging Face class name -> model type, for a config.json that names only the class.
HF_ARCHITECTURE_TO_TYPE = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                           "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
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
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3), if it differs
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power; None: head_dim
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # The file's bytes per block type (GGUF: Q4_K, Q6_K, F32, ...; safetensors: BF16, ...).
    block_type_to_num_bytes: dict[str, int] | None = dataclasses.field(default=None, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_layer_linear_params(self) -> int:
        """Parameters of the matrices in all decoder layers (q, k, v, o, gate, up, down)."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
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
    def num_step_params(self) -> int:
        """Parameters a decode step reads whole: the layer matrices and the output projection."""
        return self.num_layer_linear_params + self.num_embedding_params


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
    is_tied = "output.weight" not in gguf.tensors
    total_bytes = sum(t.num_bytes for t in tensors)
    block_type_to_num_bytes: dict[str, int] = collections.Counter()
    for tensor in tensors:
        block_type_to_num_bytes[tensor.ggml_type.name] += tensor.num_bytes
    num_elements = sum(t.num_elements for t in tensors)
    return ModelShape(
        name=str(metadata.get("general.name") or Path(path).stem),
        architecture=arch,
        num_layers=num_layers,
        hidden_size=hidden_size,
        intermediate_size=int(get("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length", hidden_size // num_heads)),
        vocab_size=int(vocab_size),
        max_context_len=int(get("context_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=is_tied,
        has_qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        file_weight_bytes=total_bytes,
        file_step_weight_bytes=sum(t.num_bytes for t in tensors if t.name != "token_embd.weight" or is_tied),
        file_weight_bits=8 * total_bytes / num_elements if num_elements else None,
        block_type_to_num_bytes=dict(block_type_to_num_bytes),
        **gemma3_fields(metadata, path, num_layers) if arch == "gemma3" else {},
    )


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
    try:
        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        shape = ModelShape(
            name=path.name,
            architecture=model_type or (architectures[0] if architectures else ""),
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            vocab_size=int(hf["vocab_size"]),
            max_context_len=int(hf.get("max_position_embeddings", DEFAULT_HF_CONTEXT_LEN)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            has_qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: missing or malformed field {exc}") from exc
    block_type_to_num_bytes, embedding_bytes = _safetensors_bytes(path)
    if not block_type_to_num_bytes:
        bits = _TORCH_DTYPE_TO_BITS.get(str(hf.get("torch_dtype", "bfloat16")), 16)
        return dataclasses.replace(shape, file_weight_bits=float(bits))
    total_bytes = sum(block_type_to_num_bytes.values())
    step_bytes = total_bytes if shape.tie_word_embeddings else total_bytes - embedding_bytes
    return dataclasses.replace(shape, file_weight_bytes=total_bytes, file_step_weight_bytes=step_bytes,
                               file_weight_bits=8 * total_bytes / shape.num_params,
                               block_type_to_num_bytes=block_type_to_num_bytes)


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


def _safetensors_bytes(path: Path) -> tuple[dict[str, int], int]:
    """(bytes per dtype, bytes of the token embedding) from the safetensors headers; no files: ({}, 0)."""
    dtype_to_num_bytes: dict[str, int] = collections.Counter()
    embedding = 0
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
    return dict(dtype_to_num_bytes), embedding

