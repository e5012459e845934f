"""Every architecture the README names, on a file as llama.cpp's converter writes it, against
transformers on the same weights (float32): tiny seeded random models (converted.py) of each
family, loaded by the engine from the converted GGUF and from the Hugging Face directory.

For each: the engine's tokenizer gives transformers' ids on the test text; the greedy
continuation is transformers' own; and the logits at every position of prompt plus
continuation agree within LOGITS_RTOL of their spread. The prompt is long enough (PROMPT_TOKENS)
to cross every family's sliding window and RoPE scaling boundary where the tiny config has one.

Tolerance: the tiny models' logits span tens of units; the largest difference measured here
was below 1e-4 of that spread (float32, different summation orders), and LOGITS_RTOL leaves
ten times that, far below the gap between the top two logits that greedy decisions depend on.
"""

from __future__ import annotations

import pytest
import torch

from converted import TinyFamily, converted_model
from reference import engine_prompt_logits, reference_greedy, reference_logits
from tokios.sampling_params import SamplingParams

NUM_TOKENS = 16
PROMPT_TOKENS = 160
LOGITS_RTOL = 1e-3
TEXT = ("The lighthouse keeper climbed the stairs every evening, counting each of the one hundred and twelve "
        "steps, because his father had counted them and his grandfather before him. Der Leuchtturm stand auf "
        "einer Klippe; 灯台は岬の上に立っていた。 Kraków, Zürich, naïve café — 1234567890 + 0.5 = ? ") * 4


def _transformers():
    return pytest.importorskip("transformers")


def qwen2_config(vocab_size: int):
    return _transformers().Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=1e6, tie_word_embeddings=True,
        initializer_range=0.5)


def mistral_config(vocab_size: int):
    # No sliding window: llama.cpp's converter does not carry Mistral's (as its own runtime ignores it).
    return _transformers().MistralConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=1024, rope_theta=1e6, sliding_window=None,
        tie_word_embeddings=False, initializer_range=0.5)


def qwen3_config(vocab_size: int, rope_parameters: dict | None = None, max_position_embeddings: int = 1024):
    # Qwen3's head_dim of 128 with 8 heads over a 64-wide hidden state: q is 1024 wide, so a
    # head_dim taken as hidden / heads would not load. Four layers make 8 KiB of float32 KV a
    # token, so that the preemption scenario (test_engine_invariance.py) fits its few blocks
    # into the smallest KV cache the engine takes.
    return _transformers().Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, **(rope_parameters or {})},
        tie_word_embeddings=True, initializer_range=0.5)


def qwen3_yarn_config(vocab_size: int):
    # YaRN over an original context of 64: the 160-token prompt runs well past it. beta_fast 8
    # and beta_slow 0.5 (not the defaults, so the converter writes them) put the ramp over
    # dimensions 1 to 14 of 64: some kept, some blended, most interpolated.
    return qwen3_config(vocab_size, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                     "beta_fast": 8.0, "beta_slow": 0.5},
                        max_position_embeddings=256)


def llama3_config(vocab_size: int):
    # Llama 3.x's scaling over an original context of 64 (the converter writes it as the
    # rope_freqs tensor): with head_dim 16 and base 500,000 the dimensions fall in all three of
    # its bands (kept, blended, divided by the factor).
    return _transformers().LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False, initializer_range=0.5)


FAMILIES = {
    family.name: family for family in (
        TinyFamily("qwen2", qwen2_config, vocab="qwen2", random_biases=True),
        TinyFamily("mistral", mistral_config, vocab="llama-bpe"),
        TinyFamily("qwen3", qwen3_config, vocab="qwen2", random_norms=True),
        TinyFamily("qwen3-yarn", qwen3_yarn_config, vocab="qwen2", random_norms=True),
        TinyFamily("llama3", llama3_config, vocab="llama-bpe"),
    )
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    return converted_model(FAMILIES[request.param], tmp_path_factory)


@pytest.fixture(scope="module", params=["gguf", "hf_directory"])
def tiny_engine(request, tiny):
    from tokios.engine import LLM

    path = tiny.gguf_path if request.param == "gguf" else tiny.hf_directory
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory="64MiB")
    yield tiny, llm
    llm.close()


def prompt_ids(tiny) -> list[int]:
    from converted import vocab_tokenizer

    return vocab_tokenizer(tiny.family.vocab)(TEXT, add_special_tokens=False).input_ids[:PROMPT_TOKENS]


def test_tokenizer_gives_transformers_ids(tiny_engine):
    tiny, llm = tiny_engine
    from converted import vocab_tokenizer

    expected = vocab_tokenizer(tiny.family.vocab)(TEXT, add_special_tokens=False).input_ids
    assert llm.tokenizer.encode(TEXT, add_special_tokens=False) == expected


def test_greedy_continuation_and_logits_match_transformers(tiny_engine):
    tiny, llm = tiny_engine
    ids = prompt_ids(tiny)
    expected = reference_greedy(tiny.reference, ids, NUM_TOKENS)
    (output,) = llm.generate([ids], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert list(output.outputs[0].token_ids) == expected
    assert len(set(expected)) > 1, "the tiny model repeats one token: its weights are too small to test anything"
    everything = ids + expected
    ours, theirs = engine_prompt_logits(llm, everything).double(), reference_logits(tiny.reference, everything).double()
    spread = (theirs.max() - theirs.min()).item()
    difference = (ours - theirs).abs().max().item()
    assert difference <= LOGITS_RTOL * spread, f"largest logit difference {difference:.3g} over a spread of {spread:.3g}"


def test_an_unknown_rope_scaling_is_an_error_naming_it(tmp_path_factory, tmp_path):
    import json
    import shutil

    from tokios.engine import LLM
    from tokios.errors import UnsupportedError

    directory = shutil.copytree(converted_model(FAMILIES["qwen3-yarn"], tmp_path_factory).hf_directory, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "dynamic"
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="RoPE scaling type 'dynamic' is not supported"):
        LLM(model=str(directory), dtype="float32", kv_cache_memory="16MiB")
