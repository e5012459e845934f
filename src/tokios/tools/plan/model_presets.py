"""Model shapes for capacity planning: built-in presets, GGUF files and Hugging Face directories.

Owns `ModelShape` (the few numbers the plan and roofline formulas need: layers, widths, heads,
vocabulary, context, and the weight bytes when a file tells us) and `load_model_shape(spec)`,
which accepts a preset name, a GGUF file or an HF directory. It never imports torch, so
`tokios plan` stays instant; used by tools/plan/capacity.py, tools/plan/cli.py, tools/roofline/
and the server (server/cli.py's memory estimate, the Ollama dialect's model facts).

GGUF headers are read by the shared parser (tokios/gguf_file.py), which walks the metadata and
the tensor infos in milliseconds where gguf.GGUFReader takes seconds and imports no torch.
Parameter counts and weight bytes come from the tensor shapes and types.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tokios.errors import InvalidRequestError, ModelLoadError

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer (Llama family) described by its shapes.

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
    # Per layer: its sliding window in tokens, or None for full attention (None: all full).
    layer_windows: tuple[int | None, ...] | None = None

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


def _llama(name: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int,
           context: int, *, tied: bool = False, qkv_bias: bool = False) -> ModelShape:
    return ModelShape(name, layers, hidden, inter, heads, kv_heads, hidden // heads, vocab, context,
                      tie_word_embeddings=tied, has_qkv_bias=qkv_bias)


# Shapes from each model's published config.json.
NAME_TO_PRESET: dict[str, ModelShape] = {
    preset.name: preset
    for preset in (
        _llama("llama-3-70b", 80, 8192, 28672, 64, 8, 128256, 8192),
        _llama("llama-3-8b", 32, 4096, 14336, 32, 8, 128256, 8192),
        # Llama-2-70B itself uses GQA (8 KV heads); the 7B and 13B are the no-GQA members.
        _llama("llama-2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
        _llama("llama-2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
        _llama("llama-2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32768, 32768),
        _llama("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, 32768, qkv_bias=True),
        _llama("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, tied=True),
    )
}


def load_model_shape(spec: str) -> ModelShape:
    """Resolve `spec`: a preset name, a GGUF file, or a Hugging Face model directory."""
    if spec in NAME_TO_PRESET:
        return NAME_TO_PRESET[spec]
    path = Path(spec).expanduser()
    if path.is_dir():
        return _shape_from_hf_dir(path)
    if path.is_file():
        return _shape_from_gguf(path)
    raise InvalidRequestError(
        f"model: {spec!r} is neither a preset ({', '.join(NAME_TO_PRESET)}) nor an existing "
        "GGUF file or Hugging Face directory",
        param="model",
    )


def _shape_from_gguf(path: Path) -> ModelShape:
    from tokios.gguf_file import GGUFFile
    from tokios.model.gemma3_metadata import gemma3_fields

    gguf = GGUFFile(path)
    metadata = gguf.metadata
    tensors = list(gguf.tensors.values())
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelLoadError(f"{path}: GGUF has no general.architecture")

    def field(key: str, default: int | None = None) -> int:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return int(value)

    hidden = field("embedding_length")
    heads = field("attention.head_count")
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    if not vocab:
        raise ModelLoadError(f"{path}: GGUF has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    names = set(gguf.tensors)
    is_tied = "output.weight" not in names
    step_bytes = sum(
        t.num_bytes for t in tensors if t.name != "token_embd.weight" or is_tied
    )
    num_params = sum(t.num_elements for t in tensors)
    total_bytes = sum(t.num_bytes for t in tensors)
    return ModelShape(
        name=str(metadata.get("general.name") or path.stem),
        num_layers=field("block_count"),
        hidden_size=hidden,
        intermediate_size=field("feed_forward_length"),
        num_heads=heads,
        num_kv_heads=field("attention.head_count_kv", heads),
        head_dim=field("attention.key_length", hidden // heads),
        vocab_size=int(vocab),
        max_context_len=field("context_length"),
        tie_word_embeddings=is_tied,
        has_qkv_bias="blk.0.attn_q.bias" in names,
        file_weight_bytes=total_bytes,
        file_step_weight_bytes=step_bytes,
        file_weight_bits=8 * total_bytes / num_params,
        layer_windows=gemma3_fields(metadata, str(path), field("block_count"))["layer_windows"]
        if arch == "gemma3" else None,
    )


_SAFETENSORS_DTYPE_TO_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I8": 1, "U8": 1,
                               "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8, "I16": 2, "BOOL": 1}
_TORCH_DTYPE_TO_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


def _shape_from_hf_dir(path: Path) -> ModelShape:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json in this Hugging Face model directory")
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)  # multimodal wrappers nest the language model
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        shape = ModelShape(
            name=path.name,
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            vocab_size=int(config["vocab_size"]),
            max_context_len=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            has_qkv_bias=bool(config.get("attention_bias", config.get("model_type") == "qwen2")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: missing or malformed field {exc}") from exc
    file_bytes = _safetensors_weight_bytes(path)
    if file_bytes is None:
        bits = _TORCH_DTYPE_TO_BITS.get(str(config.get("torch_dtype", "bfloat16")), 16)
        return dataclasses.replace(shape, file_weight_bits=float(bits))
    total_bytes, embedding_bytes = file_bytes
    step_bytes = total_bytes if shape.tie_word_embeddings else total_bytes - embedding_bytes
    return dataclasses.replace(shape, file_weight_bytes=total_bytes, file_step_weight_bytes=step_bytes,
                               file_weight_bits=8 * total_bytes / shape.num_params)


def _safetensors_weight_bytes(path: Path) -> tuple[int, int] | None:
    """(all weight bytes, embedding bytes) from the safetensors headers, or None if none exist."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    total = embedding = 0
    for file in files:
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
            total += num_bytes
            if name.endswith("embed_tokens.weight"):
                embedding += num_bytes
    return total, embedding
