"""Perplexity gate: the engine's perplexity on a fixed ~1,000-token English text must be within
1% of transformers' float32 perplexity, for every weight format `--dtype` offers.

The engine's figure comes through the public path (SamplingParams(prompt_logprobs=0) on a
1,010-token prompt, which the default 512-token budget prefills in two chunks), transformers'
from one forward pass, read from the golden file tests/data/golden/smollm2.json (golden.py;
test_parity.py checks that file against live transformers). A format that this build cannot run (UnsupportedError or ImportError at
load) is skipped with the reason; any other failure is a failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from golden import load_golden
from reference import default_gguf, engine_perplexity
from tokios.config import SUPPORTED_DTYPES
from tokios.errors import UnsupportedError
from tokios.sampling_params import SamplingParams

TEXT_PATH = Path(__file__).parent.parent / "data" / "perplexity_text.txt"
MAX_RELATIVE_GAP = 0.01
# float32 runs the same maths as the reference, so it must agree far more closely than the gate.
MAX_RELATIVE_GAP_FLOAT32 = 1e-4
WEIGHT_FORMATS = [dtype for dtype in SUPPORTED_DTYPES if dtype != "auto"]


@pytest.fixture(scope="module")
def text_token_ids(engine_float32) -> list[int]:
    token_ids = engine_float32.tokenizer.encode(TEXT_PATH.read_text(encoding="utf-8"))
    assert 900 <= len(token_ids) <= 1100
    return token_ids


@pytest.fixture(scope="module")
def reference_perplexity(text_token_ids) -> float:
    golden = load_golden("smollm2", default_gguf())["perplexity"]
    assert text_token_ids == golden["token_ids"], "the text's ids changed: regenerate smollm2.json"
    return golden["value"]


@pytest.mark.parametrize("dtype", WEIGHT_FORMATS)
def test_perplexity_within_one_percent_of_transformers(dtype, text_token_ids, reference_perplexity):
    from tokios.engine import LLM

    try:
        llm = LLM(dtype=dtype, kv_cache_memory="64MiB")
    except (UnsupportedError, ImportError) as exc:
        pytest.skip(f"--dtype {dtype} is not available in this build: {exc}")
    ours = engine_perplexity(llm, text_token_ids)
    llm.check_invariants()
    gap = abs(ours - reference_perplexity) / reference_perplexity
    print(f"\nperplexity dtype={dtype}: engine {ours:.4f}, transformers float32 {reference_perplexity:.4f}, "
          f"gap {gap:.3%}")
    assert gap <= (MAX_RELATIVE_GAP_FLOAT32 if dtype == "float32" else MAX_RELATIVE_GAP)


def test_int8_kv_cache_passes_the_perplexity_gate(text_token_ids, reference_perplexity):
    """--kv-cache-dtype int8 (kv_cache/dtypes.py) on the default weights: both prefill chunks
    attend through the quantized cache (the first chunk's keys are read back as int8 by the second)."""
    from tokios.engine import LLM

    llm = LLM(kv_cache_dtype="int8", kv_cache_memory="64MiB")
    ours = engine_perplexity(llm, text_token_ids)
    llm.check_invariants()
    gap = abs(ours - reference_perplexity) / reference_perplexity
    print(f"\nperplexity kv int8: engine {ours:.4f}, transformers float32 {reference_perplexity:.4f}, gap {gap:.3%}")
    assert gap <= MAX_RELATIVE_GAP


def test_reference_perplexity_is_that_of_a_language_model(reference_perplexity, text_token_ids):
    # Guards the gate itself: a broken reference (say, shifted targets) gives hundreds or more.
    assert 1.5 < reference_perplexity < 60


def test_prompt_logprobs_cover_every_position_after_a_prefix_cache_hit(engine_float32, text_token_ids):
    token_ids = text_token_ids[:40]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (cold,) = engine_float32.generate([token_ids], params)
    (warm,) = engine_float32.generate([token_ids], params)
    engine_float32.check_invariants()
    assert len(cold.prompt_logprobs) == len(token_ids)
    assert len(warm.prompt_logprobs) == len(token_ids)
    assert [list(entry) for entry in warm.prompt_logprobs[1:]] == [[token_id] for token_id in token_ids[1:]]
