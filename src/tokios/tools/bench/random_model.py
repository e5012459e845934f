"""`tokios bench random-model`: a full-size model of an architecture whose weights no package
ships, with random weights, as a GGUF file written by llama.cpp's own converter.

Speed does not depend on what the weights are, only on their shapes and block types, so a
benchmark of an architecture needs its real dimensions, not its training. The model is built with
transformers' own config and model class (seeded), saved with a real tokenizer (transformers'
reading of one of llama.cpp's ggml-vocab-*.gguf files, from the pinned sources that
peers.fetch_llama_cpp_sources provides), converted by `convert_hf_to_gguf.py` to F16 and kept
under the peers cache's models/ folder; `--quantize Q4_K_M` on the other bench commands then
requantizes it with llama-quantize, as a user's downloaded file would be. Prints the file's path.

PRESETS names each architecture's published dimensions (Qwen3-0.6B's config.json, ...).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tokios.errors import InvalidRequestError, TokiosError


@dataclass(frozen=True)
class RandomModelPreset:
    config_class: str  # transformers class name
    vocab: str  # llama.cpp's ggml-vocab-<vocab>.gguf
    config: dict = field(default_factory=dict)


PRESETS = {
    # Qwen3-0.6B's published config.json (596M parameters, tied embeddings).
    "qwen3-0.6b": RandomModelPreset("Qwen3Config", "qwen2", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    # Qwen3-30B-A3B's published config.json (48 layers, hidden 2048, 128 experts of width 768,
    # top-8, GQA 32/4 of head_dim 128) scaled down in depth, width and expert count with its
    # ratios kept: experts 1/4 of hidden wide, top-8, 4 query heads per KV head. 1.05B
    # parameters, 0.18B of them active per token beyond the (tied) embeddings.
    "qwen3-moe-1b": RandomModelPreset("Qwen3MoeConfig", "qwen2", dict(
        hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=True)),
    # gpt-oss-20b's published config.json (24 layers, hidden 2880, 32 experts of width 2880,
    # top-4, 64 query heads of 64 over 8 KV heads, sliding window 128 on every other layer, YaRN
    # 32x over 4,096) scaled down with its ratios kept: experts as wide as hidden, top-4 of 32,
    # queries wider than hidden, 8 query heads per KV head. 0.93B parameters, of which 0.11B are
    # active per token beyond the (untied) embedding and output tables. Its o200k vocabulary
    # ships in no file here: the qwen2 one stands in (so the tables are 152k rows, not 201k).
    "gpt-oss-1b": RandomModelPreset("GptOssConfig", "qwen2", dict(
        hidden_size=768, intermediate_size=768, num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=2, head_dim=64, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 6, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        tie_word_embeddings=False)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset", choices=sorted(PRESETS), help="architecture and size")
    parser.add_argument("--seed", type=int, default=0)


def random_model_path(preset_name: str, *, seed: int = 0) -> Path:
    """The preset's F16 GGUF in the peers cache, made once."""
    from tokios.tools.bench.peers import convert_hf_directory, fetch_llama_cpp_sources, peers_dir

    if preset_name not in PRESETS:
        raise InvalidRequestError(f"preset must be one of {', '.join(sorted(PRESETS))}, got {preset_name!r}",
                                  param="preset")
    target = peers_dir() / "models" / f"random-{preset_name}-seed{seed}.F16.gguf"
    if target.is_file():
        return target
    sources = fetch_llama_cpp_sources()
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise TokiosError(f"random models are built with transformers and torch: {exc}") from None
    preset = PRESETS[preset_name]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(sources / "models"),
                                                           gguf_file=f"ggml-vocab-{preset.vocab}.gguf")
    config = getattr(transformers, preset.config_class)(vocab_size=len(tokenizer), **preset.config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as directory:
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        del model
        partial = convert_hf_directory(directory, target.with_suffix(".partial"), "f16")
    partial.rename(target)
    return target


def run(args: argparse.Namespace) -> int:
    print(random_model_path(args.preset, seed=args.seed))
    return 0
