"""Parity with Hugging Face transformers on the same GGUF file, float32.

Greedy continuations of four prompts (the chat-templated "What is gravity?", plain English,
Polish, Japanese) must be identical for 48 tokens, and the logits at every position of prompt
plus continuation must agree within LOGITS_ATOL.

Tolerance: measured here, the largest difference over the four sequences was 8.1e-5 (logits
of magnitude up to 39); LOGITS_ATOL leaves about ten times that for other BLAS builds, and is
still far below the gap between the top two logits that greedy decoding depends on.
"""

from __future__ import annotations

import pytest
import torch

from reference import engine_prompt_logits, reference_greedy, reference_logits
from tokios.sampling_params import SamplingParams

NUM_TOKENS = 48
LOGITS_ATOL = 1e-3

PROMPTS = {
    "chat_gravity": [{"role": "user", "content": "What is gravity?"}],
    "english": "The old lighthouse keeper climbed the stairs every evening because",
    "polish": "Kraków jest jednym z najstarszych miast w Polsce, a jego historia",
    "japanese": "日本の首都は東京です。東京は",
}


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, list):
        return tokenizer.encode(tokenizer.apply_chat_template(prompt, add_generation_prompt=True),
                                add_special_tokens=False)
    return tokenizer.encode(prompt)


@pytest.fixture(scope="module")
def engine_continuations(engine_float32):
    """All four prompts in one batch (one-by-one equality is test_engine_invariance's job)."""
    names = sorted(PROMPTS)
    token_ids = [prompt_token_ids(engine_float32.tokenizer, PROMPTS[name]) for name in names]
    outputs = engine_float32.generate(token_ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                                                ignore_eos=True))
    engine_float32.check_invariants()
    return {name: (ids, output.outputs[0].token_ids) for name, ids, output in zip(names, token_ids, outputs)}


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_continuation_matches_transformers(name, engine_continuations, reference_model):
    prompt_ids, ours = engine_continuations[name]
    theirs = reference_greedy(reference_model, prompt_ids, NUM_TOKENS)
    assert len(ours) == NUM_TOKENS
    assert ours == theirs


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_at_every_position_match_transformers(name, engine_continuations, engine_float32, reference_model):
    prompt_ids, continuation = engine_continuations[name]
    token_ids = prompt_ids + continuation
    ours = engine_prompt_logits(engine_float32, token_ids)
    theirs = reference_logits(reference_model, token_ids)
    assert ours.shape == theirs.shape == (len(token_ids), engine_float32.model_config.vocab_size)
    difference = (ours - theirs).abs().max().item()
    assert difference <= LOGITS_ATOL, f"largest logit difference {difference:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_chat_prompt_is_rendered_as_transformers_renders_it(engine_float32):
    transformers = pytest.importorskip("transformers")
    from reference import default_gguf

    path = default_gguf()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = hf_tokenizer.apply_chat_template(PROMPTS["chat_gravity"], add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert prompt_token_ids(engine_float32.tokenizer, PROMPTS["chat_gravity"]) == list(expected)
