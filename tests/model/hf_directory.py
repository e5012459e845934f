"""Writes a Hugging Face model directory (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) from a ModelConfig, weights in Hugging Face names, and an engine tokenizer:
the default model's own weights (test_hf_dir.py) or random ones of another shape
(test_parallel.py), with the default model's tokenizer and chat template either way."""

from __future__ import annotations

import json

from tokios.model.quant import as_dense


def write_hf_directory(directory, tokenizer, config, weights: dict) -> None:
    from safetensors.torch import save_file

    dense = {name: as_dense(weight).contiguous() for name, weight in weights.items()}
    save_file(dense, str(directory / "model.safetensors"))
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "num_hidden_layers": config.num_layers,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_model_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "chat_template": tokenizer.chat_template,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=2))
