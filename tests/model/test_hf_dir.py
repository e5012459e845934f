"""A Hugging Face model directory loads and generates exactly what the GGUF file does.

The test writes the directory itself from the default GGUF: config.json from the GGUF's
ModelConfig, tokenizer.json from the engine tokenizer's `tokenizers` pipeline,
tokenizer_config.json with the chat template and special tokens, and model.safetensors with
the dequantized weights (the loader keeps Q4_1/Q8_0 packed; as_dense
unpacks them) in Hugging Face names and layout. Both engines run in float32 on the
same weights, so greedy tokens (and where they stop) must be identical.
"""

from __future__ import annotations

import pytest
import torch

from hf_directory import write_hf_directory
from reference import default_gguf, prompt_token_ids
from tokios.gguf_file import GGUFFile
from tokios.model.loader import model_config_from_gguf, weights_from_gguf
from tokios.sampling_params import SamplingParams

PROMPTS = [
    [{"role": "system", "content": "You answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    "Zażółć gęślą jaźń, said the teacher, and the children",
    "東京タワーの高さは",
]


@pytest.fixture(scope="module")
def hf_dir_engine(tmp_path_factory, engine_float32):
    from tokios.engine import LLM

    directory = tmp_path_factory.mktemp("smollm2-hf")
    path = default_gguf()
    gguf = GGUFFile(path)
    config = model_config_from_gguf(gguf)
    write_hf_directory(directory, engine_float32.tokenizer, config, weights_from_gguf(gguf, config))
    return LLM(model=str(directory), dtype="float32", kv_cache_memory="64MiB")


def test_directory_describes_the_same_model(hf_dir_engine, engine_float32):
    assert hf_dir_engine.model_config.architecture == "llama"
    for field in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "max_model_len", "rope_theta", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(hf_dir_engine.model_config, field) == getattr(engine_float32.model_config, field), field
    assert hf_dir_engine.weight_bytes() == engine_float32.weight_bytes()


def test_directory_tokenizer_and_chat_template_match_the_gguf(hf_dir_engine, engine_float32):
    ours, theirs = hf_dir_engine.tokenizer, engine_float32.tokenizer
    assert ours.eos_token_ids == theirs.eos_token_ids
    for prompt in PROMPTS:
        assert prompt_token_ids(ours, prompt) == prompt_token_ids(theirs, prompt)
        if isinstance(prompt, list):
            assert ours.apply_chat_template(prompt) == theirs.apply_chat_template(prompt)


def test_greedy_output_equals_the_gguf_engine(hf_dir_engine, engine_float32):
    params = SamplingParams(max_tokens=16, temperature=0.0)  # EOS honoured: both must stop alike
    prompts = [prompt_token_ids(engine_float32.tokenizer, p) for p in PROMPTS]
    from_dir = hf_dir_engine.generate(prompts, params)
    from_gguf = engine_float32.generate(prompts, params)
    for ours, theirs in zip(from_dir, from_gguf):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert ours.outputs[0].text == theirs.outputs[0].text
        assert ours.outputs[0].finish_reason == theirs.outputs[0].finish_reason
    hf_dir_engine.check_invariants()
    engine_float32.check_invariants()


def test_a_directory_saved_by_transformers_in_bfloat16_runs_as_stored(tmp_path, reference_model, engine_float32):
    """The directory a user downloads: config.json in the schema of the installed transformers
    (5 and later keep the RoPE base under rope_parameters) and bfloat16 safetensors. --dtype auto
    runs its products in bfloat16, and must be the same model: the GGUF's config, and prompt
    logprobs as close to the float32 engine as bfloat16 rounding allows."""
    from safetensors.torch import save_file

    from reference import load_reference_tokenizer
    from tokios.engine import LLM

    reference_model.config.save_pretrained(tmp_path)
    load_reference_tokenizer(default_gguf()).save_pretrained(tmp_path)
    save_file({name: tensor.to(torch.bfloat16).contiguous() for name, tensor in reference_model.state_dict().items()
               if name != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    llm = LLM(model=str(tmp_path), kv_cache_memory="64MiB")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size", "rope_theta",
                  "rope_scaling", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(llm.model_config, field) == getattr(engine_float32.model_config, field), field
    assert "bfloat16" in llm.core.model.weight_summary()

    prompt = prompt_token_ids(engine_float32.tokenizer, PROMPTS[0])
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)

    def prompt_logprobs(engine) -> list[float]:
        (output,) = engine.generate([prompt], params)
        return [next(iter(entry.values())).logprob for entry in output.prompt_logprobs[1:]]

    ours, reference = prompt_logprobs(llm), prompt_logprobs(engine_float32)
    # Measured: 0.026 nats; with the RoPE base at the old default (10,000), 0.087.
    assert sum(abs(a - b) for a, b in zip(ours, reference)) / len(reference) < 0.05
    llm.check_invariants()
