"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, architecture qwen2: attention biases, RoPE base 1e6,
Q5_0/Q4_K/Q6_K/Q8_0 tensors, a 151,936-token vocabulary) against transformers float32 on the
same file.

transformers' results are read from the golden file tests/data/golden/qwen25.json (golden.py,
make_golden.py: transformers takes about a minute to dequantize this file, so it is not loaded
on every run). The live transformers comparison of the qwen2 architecture is the tiny converted
model in test_families.py; this file is the real one as users download it.

- Greedy continuations of the prompts (plain completion, the chat template, code) are
  transformers' for NUM_TOKENS tokens: "The capital of France is" continues " Paris. Paris is
  located in the northwestern part of France", where un-permuting qwen2's Q/K rows (as for
  llama) made it degenerate into "Paris Paris Paris".
- The logits at every position of prompt plus continuation agree with the golden top-k and
  logsumexp within LOGITS_ATOL, with the same argmax. Measured here (Zen 4): largest difference
  3.6e-5 over logits of magnitude up to 32; the smallest top-two gap along the continuations is
  0.020, forty times LOGITS_ATOL.
- The chat template renders as transformers renders it.
"""

from __future__ import annotations

import pytest

from golden import golden_sequences as checked_golden_sequences
from golden import greedy_continuations, largest_summary_difference, load_golden
from reference import engine_prompt_logits
from tokios.model_files import qwen25_model_path

NUM_TOKENS = 24
LOGITS_ATOL = 5e-4
PROMPTS = {
    "capital": "The capital of France is",
    "chat_reverse": [{"role": "user", "content": "Write a Python function that reverses a string."}],
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}


@pytest.fixture(scope="module")
def qwen25_float32():
    from tokios.engine import LLM

    llm = LLM(model=str(qwen25_model_path()), dtype="float32", kv_cache_memory="128MiB")
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def continuations(qwen25_float32):
    return greedy_continuations(qwen25_float32, PROMPTS, NUM_TOKENS)


@pytest.fixture(scope="module")
def golden_sequences(continuations):
    return checked_golden_sequences("qwen25", qwen25_model_path(), continuations)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_continuation_matches_transformers(name, continuations, golden_sequences):
    assert continuations[name][1] == golden_sequences[name]["greedy_ids"]


def test_the_capital_of_france_continues_as_transformers_does(continuations, qwen25_float32):
    text = qwen25_float32.tokenizer.decode(continuations["capital"][1])
    assert text.startswith(" Paris. Paris is located in the northwestern part of France"), text


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_logits_at_every_position_match_transformers(name, continuations, qwen25_float32, golden_sequences):
    prompt_ids, continuation = continuations[name]
    ours = engine_prompt_logits(qwen25_float32, prompt_ids + continuation)
    difference = largest_summary_difference(ours, golden_sequences[name])
    assert difference <= LOGITS_ATOL, f"largest logit difference {difference:.2e}"


def test_chat_prompt_is_rendered_as_transformers_renders_it(qwen25_float32):
    assert qwen25_float32.tokenizer.apply_chat_template(PROMPTS["chat_reverse"], add_generation_prompt=True) == \
        load_golden("qwen25", qwen25_model_path())["chat_text"]
