"""Model shapes for capacity planning: built-in presets, or a model file's own shape.

Owns `NAME_TO_PRESET` (published models' shapes, written by hand as model/shape.py's
ModelShape) and `load_model_shape(spec)`, which accepts a preset name, a GGUF file or an HF
directory (read by model/shape.py, as the engine reads them). Used by tools/plan/cli.py,
tools/simulate/cli.py and the tests; never imports torch, so `tokios plan` stays instant.
"""

from __future__ import annotations

from pathlib import Path

from tokios.errors import InvalidRequestError
from tokios.model.shape import ModelShape, read_model_shape


def _llama(name: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, vocab: int,
           context: int, *, tied: bool = False, qkv_bias: bool = False, architecture: str = "llama") -> ModelShape:
    return ModelShape(name, layers, hidden, inter, heads, kv_heads, hidden // heads, vocab, context,
                      tie_word_embeddings=tied, has_qkv_bias=qkv_bias, architecture=architecture)


def _moe(name: str, layers: int, hidden: int, inter: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
         context: int, *, num_experts: int, num_experts_per_token: int, expert_inter: int,
         qkv_bias: bool = False, layer_windows: tuple[int | None, ...] | None = None,
         architecture: str) -> ModelShape:
    return ModelShape(name, layers, hidden, inter, heads, kv_heads, head_dim, vocab, context,
                      has_qkv_bias=qkv_bias, layer_windows=layer_windows, architecture=architecture,
                      num_experts=num_experts, num_experts_per_token=num_experts_per_token,
                      expert_intermediate_size=expert_inter)


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
        _llama("mistral-7b", 32, 4096, 14336, 32, 8, 32768, 32768, architecture="mistral"),
        _llama("qwen2.5-7b", 28, 3584, 18944, 28, 4, 152064, 32768, qkv_bias=True, architecture="qwen2"),
        _llama("smollm2-135m", 30, 576, 1536, 9, 3, 49152, 8192, tied=True),
        # Mixtures of experts, from the config.json of Qwen/Qwen3-30B-A3B (moe_intermediate_size 768;
        # its intermediate_size 6144 is no layer's), openai/gpt-oss-20b (sliding window of 128 on
        # every other layer, from the first; attention biases), mistralai/Mixtral-8x7B-v0.1 and
        # allenai/OLMoE-1B-7B-0924 (experts intermediate_size wide). Published totals / active:
        # 30.5B / 3.3B, 21B / 3.6B (active without the embedding table), 46.7B / 12.9B, 6.9B / 1.3B.
        _moe("qwen3-30b-a3b", 48, 2048, 6144, 32, 4, 128, 151936, 40960, num_experts=128,
             num_experts_per_token=8, expert_inter=768, architecture="qwen3moe"),
        _moe("gpt-oss-20b", 24, 2880, 2880, 64, 8, 64, 201088, 131072, num_experts=32,
             num_experts_per_token=4, expert_inter=2880, qkv_bias=True, layer_windows=(128, None) * 12,
             architecture="gpt-oss"),
        _moe("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32000, 32768, num_experts=8,
             num_experts_per_token=2, expert_inter=14336, architecture="llama"),
        _moe("olmoe-1b-7b", 16, 2048, 1024, 16, 16, 128, 50304, 4096, num_experts=64,
             num_experts_per_token=8, expert_inter=1024, architecture="olmoe"),
    )
}


def load_model_shape(spec: str) -> ModelShape:
    """Resolve `spec`: a preset name, a GGUF file, or a Hugging Face model directory."""
    if spec in NAME_TO_PRESET:
        return NAME_TO_PRESET[spec]
    path = Path(spec).expanduser()
    if path.is_dir() or path.is_file():
        return read_model_shape(path)
    raise InvalidRequestError(
        f"model: {spec!r} is neither a preset ({', '.join(NAME_TO_PRESET)}) nor an existing "
        "GGUF file or Hugging Face directory",
        param="model",
    )
