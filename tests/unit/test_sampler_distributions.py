"""The sampler draws from the distribution each setting's definition says.

Each test computes the expected distribution independently in numpy (float64), draws 20k samples
as rows of one batch with a fixed seed, and runs a chi-square goodness-of-fit test at p = 0.001
(p-value from torch.special.gammaincc, so no scipy). Cells the definition gives zero probability
must get zero samples, exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokios.sampler import Sampler, SamplingMetadata
from tokios.sampler import ops
from tokios.sampling_params import SamplingParams

NUM_SAMPLES = 20_000
P_VALUE_THRESHOLD = 1e-3
# Distinct, untied logits over a small vocab; some positive and some negative (repetition penalty
# treats the two signs differently).
LOGITS = np.array([2.0, 1.5, 1.1, 0.7, 0.3, -0.1, -0.4, -0.9, -1.3, -2.0, 0.9, 0.05])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def expected_top_k(probs: np.ndarray, k: int) -> np.ndarray:
    kept = np.zeros_like(probs)
    top = np.argsort(-probs)[:k]
    kept[top] = probs[top]
    return kept / kept.sum()


def expected_top_p(probs: np.ndarray, p: float) -> np.ndarray:
    order = np.argsort(-probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    kept = np.zeros_like(probs)
    kept[order[mass_before < p]] = probs[order[mass_before < p]]
    return kept / kept.sum()


def expected_min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    kept = np.where(probs >= min_p * probs.max(), probs, 0.0)
    return kept / kept.sum()


def draw_counts(params: SamplingParams, prompt=(), output=(), logits=LOGITS, seed=1234) -> np.ndarray:
    vocab_size = len(logits)
    batch = torch.tensor(logits, dtype=torch.float32).repeat(NUM_SAMPLES, 1)
    metadata = SamplingMetadata.build(
        [params] * NUM_SAMPLES,
        [list(prompt)] * NUM_SAMPLES,
        [list(output)] * NUM_SAMPLES,
        [None] * NUM_SAMPLES,
        [frozenset()] * NUM_SAMPLES,
        vocab_size,
        "cpu",
    )
    sampled = Sampler(torch.Generator().manual_seed(seed))(batch, metadata).sampled_token_ids
    return np.bincount(sampled.numpy(), minlength=vocab_size)


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of observed counts under expected_probs; zero-probability cells must be empty."""
    impossible = expected_probs == 0
    assert observed[impossible].sum() == 0, f"drew tokens of zero probability: {np.nonzero(observed * impossible)}"
    expected = expected_probs[~impossible] * observed.sum()
    observed = observed[~impossible].astype(np.float64)
    # Cells expecting < 5 samples are pooled into one, as the chi-square approximation requires.
    rare = expected < 5
    if rare.any():
        expected = np.append(expected[~rare], expected[rare].sum())
        observed = np.append(observed[~rare], observed[rare].sum())
    statistic = ((observed - expected) ** 2 / expected).sum()
    degrees_of_freedom = len(expected) - 1
    if degrees_of_freedom == 0:
        return 1.0
    return float(
        torch.special.gammaincc(
            torch.tensor(degrees_of_freedom / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def assert_follows(observed: np.ndarray, expected_probs: np.ndarray) -> None:
    p_value = chi_square_p_value(observed, expected_probs)
    assert p_value > P_VALUE_THRESHOLD, f"p={p_value:.2e}\nobserved {observed}\nexpected {expected_probs * observed.sum()}"


@pytest.mark.parametrize("temperature", [1.0, 0.5, 1.7])
def test_temperature(temperature):
    assert_follows(draw_counts(SamplingParams(temperature=temperature)), softmax(LOGITS / temperature))


def test_chi_square_detects_a_wrong_distribution():
    # The check has power: samples at temperature 0.5 do not pass as temperature 1.
    observed = draw_counts(SamplingParams(temperature=0.5))
    assert chi_square_p_value(observed, softmax(LOGITS)) < P_VALUE_THRESHOLD


@pytest.mark.parametrize("top_k", [1, 3, 7])
def test_top_k(top_k):
    params = SamplingParams(temperature=0.9, top_k=top_k)
    assert_follows(draw_counts(params), expected_top_k(softmax(LOGITS / 0.9), top_k))


@pytest.mark.parametrize("top_p", [0.3, 0.62, 0.9])
def test_top_p(top_p):
    params = SamplingParams(temperature=1.2, top_p=top_p)
    assert_follows(draw_counts(params), expected_top_p(softmax(LOGITS / 1.2), top_p))


def test_top_k_then_top_p_on_the_renormalised_top_k():
    params = SamplingParams(temperature=1.0, top_k=5, top_p=0.7)
    expected = expected_top_p(expected_top_k(softmax(LOGITS), 5), 0.7)
    assert_follows(draw_counts(params), expected)


@pytest.mark.parametrize("min_p", [0.1, 0.35])
def test_min_p(min_p):
    params = SamplingParams(temperature=0.8, min_p=min_p)
    assert_follows(draw_counts(params), expected_min_p(softmax(LOGITS / 0.8), min_p))


def test_repetition_penalty_over_prompt_and_output():
    prompt, output = [0, 7, 7], [9, 1]
    penalty = 1.8
    expected_logits = LOGITS.copy()
    for token_id in set(prompt) | set(output):
        value = expected_logits[token_id]
        expected_logits[token_id] = value / penalty if value > 0 else value * penalty
    params = SamplingParams(repetition_penalty=penalty)
    assert_follows(draw_counts(params, prompt, output), softmax(expected_logits))


def test_frequency_and_presence_penalties_count_output_tokens_only():
    prompt, output = [3, 3, 3], [0, 0, 0, 1, 2, 0]
    frequency, presence = 0.4, 0.7
    counts = np.bincount(output, minlength=len(LOGITS))
    expected_logits = LOGITS - frequency * counts - presence * (counts > 0)
    params = SamplingParams(frequency_penalty=frequency, presence_penalty=presence)
    assert_follows(draw_counts(params, prompt, output), softmax(expected_logits))


def test_negative_presence_penalty_encourages_repeats():
    output = [11, 9]
    expected_logits = LOGITS + 1.5 * (np.bincount(output, minlength=len(LOGITS)) > 0)
    assert_follows(draw_counts(SamplingParams(presence_penalty=-1.5), (), output), softmax(expected_logits))


def test_logit_bias_then_temperature():
    bias = {9: 3.0, 0: -2.5}
    expected_logits = LOGITS.copy()
    for token_id, value in bias.items():
        expected_logits[token_id] += value
    params = SamplingParams(temperature=0.7, logit_bias=bias)
    assert_follows(draw_counts(params), softmax(expected_logits / 0.7))


# -- the order of temperature and truncation is real -------------------------------------------

ORDER_LOGITS = np.log(np.array([0.5, 0.3, 0.2]))


def test_top_p_sees_the_temperature_scaled_distribution():
    # At T=1 the 0.6-nucleus of (0.5, 0.3, 0.2) is {0, 1}; at T=0.5 the distribution is
    # (0.66, 0.24, 0.11) and the nucleus is {0} alone. Temperature first -> always token 0.
    params = SamplingParams(temperature=0.5, top_p=0.6)
    observed = draw_counts(params, logits=ORDER_LOGITS)
    temperature_first = expected_top_p(softmax(ORDER_LOGITS / 0.5), 0.6)
    truncation_first = softmax(np.log(expected_top_p(softmax(ORDER_LOGITS), 0.6) + 1e-300) / 0.5)
    assert temperature_first.tolist() == [1.0, 0.0, 0.0]
    assert truncation_first[1] > 0.2
    assert observed.tolist() == [NUM_SAMPLES, 0, 0]


def test_swapping_temperature_and_top_p_changes_the_kept_set():
    logits = torch.tensor(ORDER_LOGITS, dtype=torch.float32).unsqueeze(0)
    temperature = torch.tensor([0.5])
    top_p = torch.tensor([0.6])
    temperature_first = ops.apply_top_p(ops.apply_temperature(logits, temperature), top_p)
    truncation_first = ops.apply_temperature(ops.apply_top_p(logits, top_p), temperature)
    assert torch.isfinite(temperature_first).tolist() == [[True, False, False]]
    assert torch.isfinite(truncation_first).tolist() == [[True, True, False]]


def test_swapping_top_p_and_min_p_changes_the_kept_set():
    # min-p after top-p is a ratio test on the full distribution; min-p first would renormalise
    # and shrink the nucleus. Probabilities (0.4, 0.3, 0.2, 0.1): top-p 0.75 keeps {0, 1, 2};
    # min-p 0.3 removes token 3 (0.1 < 0.12), after which top-p 0.75 keeps only {0, 1}.
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    top_p, min_p = torch.tensor([0.75]), torch.tensor([0.3])
    documented = ops.apply_min_p(ops.apply_top_p(logits, top_p), min_p)
    swapped = ops.apply_top_p(ops.apply_min_p(logits, min_p), top_p)
    assert torch.isfinite(documented).tolist() == [[True, True, True, False]]
    assert torch.isfinite(swapped).tolist() == [[True, True, False, False]]
    params = SamplingParams(top_p=0.75, min_p=0.3)
    observed = draw_counts(params, logits=logits[0].double().numpy())
    assert_follows(observed, np.array([0.4, 0.3, 0.2, 0.0]) / 0.9)


def test_inverse_cdf_across_blocks_and_a_ragged_last_block():
    # 700 tokens = 2 full 256-token blocks + a ragged one; block 1 holds no mass at all, and the
    # mass sits at both ends of blocks (where an off-by-one in the two-level search would show).
    vocab_size = 700
    probs = np.zeros(vocab_size)
    support = [0, 1, 255, 512, 513, 600, 699]
    probs[support] = [0.05, 0.2, 0.1, 0.15, 0.25, 0.05, 0.2]
    generator = torch.Generator().manual_seed(9)
    uniforms = torch.rand(NUM_SAMPLES, dtype=torch.float64, generator=generator)
    batch = torch.tensor(probs, dtype=torch.float32).repeat(NUM_SAMPLES, 1)
    sampled = ops.sample_from_probs(batch, uniforms)
    assert_follows(np.bincount(sampled.numpy(), minlength=vocab_size), probs)
