"""LongRoPE on both sides of its boundary: the tiny Phi-3 of test_families.py (original context
PHI3_ORIGINAL_CONTEXT = 64 positions, file context 1024), from the converted GGUF and from the
Hugging Face directory, against transformers run as one full pass over prompt plus continuation.

The engine picks the factor table once, by its context per sequence (model/rope.py says why):
- context 64 (at most the original): short table, which is transformers' own for a pass of at
  most 64 positions;
- context 1024: long table, transformers' own for a pass longer than 64 positions; for a
  shorter pass transformers would use the short table, so there the engine is compared with
  transformers on the same weights with the long table in place of the short one, and shown to
  differ from transformers' short-table pass.
The attention factor (sqrt(1 + ln 16 / ln 64) = 1.29 here) applies in every case.

Tolerance: test_families.py's LOGITS_RTOL of the logits' spread (measured: at most 5.3e-5 of it).
"""

from __future__ import annotations

import copy

import pytest
import torch

from converted import converted_model
from reference import engine_prompt_logits, reference_greedy, reference_logits
from test_families import FAMILIES, LOGITS_RTOL, PHI3_ORIGINAL_CONTEXT, prompt_ids
from tokios.sampling_params import SamplingParams

NUM_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return converted_model(FAMILIES["phi3"], tmp_path_factory)


@pytest.fixture(scope="module", params=["gguf", "hf_directory"])
def source(request, tiny):
    return tiny.gguf_path if request.param == "gguf" else tiny.hf_directory


def _engine(path, max_model_len: int | None):
    from tokios.engine import LLM

    return LLM(model=str(path), dtype="float32", kv_cache_memory="64MiB", max_model_len=max_model_len)


def _logit_difference(llm, reference, token_ids: list[int]) -> tuple[float, float]:
    """(largest difference of the engine's logits from the reference's, the reference's spread)."""
    ours = engine_prompt_logits(llm, token_ids).double()
    theirs = reference_logits(reference, token_ids).double()
    return (ours - theirs).abs().max().item(), (theirs.max() - theirs.min()).item()


def _with_long_table_only(reference):
    """transformers' model on the same weights, with long_factor in place of short_factor: its
    pass over any length is the long-table pass."""
    config = copy.deepcopy(reference.config)
    config.rope_parameters["short_factor"] = list(config.rope_parameters["long_factor"])
    model = type(reference)(config).eval()
    model.load_state_dict(reference.state_dict())
    return model


def _greedy_and_logits_match(llm, reference, prompt: list[int]) -> None:
    expected = reference_greedy(reference, prompt, NUM_TOKENS)
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert list(output.outputs[0].token_ids) == expected
    difference, spread = _logit_difference(llm, reference, prompt + expected)
    assert difference <= LOGITS_RTOL * spread, f"largest logit difference {difference:.3g} over a spread of {spread:.3g}"


def test_context_within_the_original_uses_the_short_table(tiny, source):
    llm = _engine(source, PHI3_ORIGINAL_CONTEXT)
    try:
        # prompt and continuation fill the context exactly: transformers' pass stays short
        _greedy_and_logits_match(llm, tiny.reference, prompt_ids(tiny)[:PHI3_ORIGINAL_CONTEXT - NUM_TOKENS])
    finally:
        llm.close()


def test_longer_context_uses_the_long_table(tiny, source):
    llm = _engine(source, None)
    try:
        # a pass longer than the original context: transformers' long table
        _greedy_and_logits_match(llm, tiny.reference, prompt_ids(tiny)[:2 * PHI3_ORIGINAL_CONTEXT])
        # a shorter sequence keeps the engine's table: the long one, not transformers' short one
        short_ids = prompt_ids(tiny)[:PHI3_ORIGINAL_CONTEXT // 2]
        difference, spread = _logit_difference(llm, _with_long_table_only(tiny.reference), short_ids)
        assert difference <= LOGITS_RTOL * spread
        difference, spread = _logit_difference(llm, tiny.reference, short_ids)
        assert difference > 10 * LOGITS_RTOL * spread
    finally:
        llm.close()
