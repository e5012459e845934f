"""The speculative rejection rule on synthetic distributions: whatever the draft proposes (from
a full distribution q, or as a point mass), the emitted tokens follow the target p. Chi-square
goodness of fit at p = 0.001 with fixed seeds, plus a power check (a wrong rule is caught), the
greedy special case, and the host-side resolution of accepted prefixes."""

from __future__ import annotations

import numpy as np
import torch

from tokios.sampler import SamplingMetadata
from tokios.sampling_params import SamplingParams
from tokios.speculative.rejection_sampler import RejectionSampler, VerifyLayout, resolve_token_ids, verify_probs

P_VALUE_THRESHOLD = 0.001
NUM_TRIALS = 20000
P0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30], dtype=torch.float64)
P1 = torch.tensor([0.40, 0.05, 0.05, 0.10, 0.20, 0.20], dtype=torch.float64)
Q0 = torch.tensor([0.30, 0.10, 0.30, 0.05, 0.20, 0.05], dtype=torch.float64)
Q1 = torch.tensor([0.10, 0.30, 0.20, 0.20, 0.10, 0.10], dtype=torch.float64)


def chi_square_p_value(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    impossible = expected_probs == 0
    assert observed[impossible].sum() == 0, f"emitted tokens of zero probability: {observed}"
    expected = expected_probs[~impossible] * observed.sum()
    observed = observed[~impossible].astype(np.float64)
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(expected) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def run_trials(draft_kind: str, seed: int = 7, accept_uniforms_override=None):
    """NUM_TRIALS requests with k = 2 proposals each; target rows p0, p1, p0 (bonus).
    Returns the emitted token lists."""
    generator = torch.Generator().manual_seed(seed)
    proposals0 = torch.multinomial(Q0, NUM_TRIALS, replacement=True, generator=generator)
    proposals1 = torch.multinomial(Q1, NUM_TRIALS, replacement=True, generator=generator)
    proposed = torch.stack([proposals0, proposals1], dim=1).reshape(-1)  # [2N]
    target = torch.stack([P0, P1, P0]).repeat(NUM_TRIALS, 1).float()  # [3N, V]
    proposed_rows = (torch.arange(NUM_TRIALS)[:, None] * 3 + torch.arange(2)).reshape(-1)
    draft_probs = torch.stack([Q0, Q1]).repeat(NUM_TRIALS, 1).float() if draft_kind == "full" else None
    accept_uniforms = torch.rand(2 * NUM_TRIALS, dtype=torch.float64, generator=generator)
    if accept_uniforms_override is not None:
        accept_uniforms = accept_uniforms_override(accept_uniforms)
    row_uniforms = torch.rand(3 * NUM_TRIALS, dtype=torch.float64, generator=generator)
    result = verify_probs(target, proposed_rows, proposed, draft_probs, accept_uniforms, row_uniforms)
    proposed_lists = proposed.view(NUM_TRIALS, 2).tolist()
    return resolve_token_ids(proposed_lists, result.is_accepted.tolist(), result.candidate_token_ids.tolist())


def first_and_second(emitted: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    vocab = P0.shape[0]
    first = np.bincount([tokens[0] for tokens in emitted], minlength=vocab)
    second = np.bincount([tokens[1] for tokens in emitted if len(tokens) >= 2], minlength=vocab)
    return first, second


def test_full_draft_distribution_emits_tokens_distributed_as_the_target():
    first, second = first_and_second(run_trials("full"))
    assert chi_square_p_value(first, P0.numpy()) > P_VALUE_THRESHOLD
    # Given the first proposal was accepted, the second token follows the second row's p.
    assert chi_square_p_value(second, P1.numpy()) > P_VALUE_THRESHOLD


def test_point_mass_proposals_emit_tokens_distributed_as_the_target():
    # The proposals are drawn from Q but verified as point masses (an n-gram or greedy draft).
    first, second = first_and_second(run_trials("point_mass", seed=11))
    assert chi_square_p_value(first, P0.numpy()) > P_VALUE_THRESHOLD
    assert chi_square_p_value(second, P1.numpy()) > P_VALUE_THRESHOLD


def test_chi_square_catches_a_rule_that_always_accepts():
    # Power check: accepting every proposal with p > 0 yields Q restricted to p's support, not P.
    first, _ = first_and_second(run_trials("full", accept_uniforms_override=torch.zeros_like))
    assert chi_square_p_value(first, P0.numpy()) < P_VALUE_THRESHOLD


def test_a_zero_probability_token_is_never_accepted_or_emitted():
    emitted = run_trials("full", seed=3)
    assert all(4 not in tokens[:1] for tokens in emitted)  # P0[4] == 0


def test_greedy_accepts_while_the_argmax_matches_then_emits_the_argmax():
    vocab = 8
    logits = torch.full((4, vocab), -5.0)
    for row, best in enumerate([3, 5, 1, 7]):
        logits[row, best] = 5.0
    params = [SamplingParams(temperature=0.0)] * 4
    metadata = SamplingMetadata.build(params, [[0]] * 4, [[]] * 4, [None] * 4, [frozenset()] * 4, vocab, "cpu")
    sampler = RejectionSampler(torch.Generator().manual_seed(0))
    # Request A: proposals [3, 5, 2] -> rows 0..3 argmax [3, 5, 1, 7]: 3, 5 accepted, 2 rejected -> 1.
    result = sampler(logits, metadata, VerifyLayout.of([[3, 5, 2]]))
    assert result.is_accepted.tolist() == [True, True, False]
    assert resolve_token_ids([[3, 5, 2]], result.is_accepted.tolist(),
                             result.candidate_token_ids.tolist()) == [[3, 5, 1]]
    # All accepted -> the bonus token from the last row.
    result = sampler(logits, metadata, VerifyLayout.of([[3, 5, 1]]))
    assert resolve_token_ids([[3, 5, 1]], result.is_accepted.tolist(),
                             result.candidate_token_ids.tolist()) == [[3, 5, 1, 7]]


def test_greedy_with_logit_edits_goes_through_the_processed_probabilities():
    # logit_bias makes the argmax token 2 at every row: the general (non plain-greedy) path.
    vocab = 8
    logits = torch.zeros(3, vocab)
    logits[:, 4] = 1.0
    params = [SamplingParams(temperature=0.0, logit_bias={2: 5.0})] * 3
    metadata = SamplingMetadata.build(params, [[0]] * 3, [[]] * 3, [None] * 3, [frozenset()] * 3, vocab, "cpu")
    result = RejectionSampler(torch.Generator().manual_seed(0))(logits, metadata, VerifyLayout.of([[2, 4]]))
    assert result.is_accepted.tolist() == [True, False]
    assert result.candidate_token_ids.tolist()[1] == 2


def test_resolve_token_ids_walks_each_request_to_its_first_rejection():
    proposed = [[10, 11], [], [20, 21, 22]]
    is_accepted = [True, True, True, False, True]
    candidates = [90, 91, 92, 93, 94, 95, 96, 97]  # rows: A 0-2, B 3, C 4-7
    assert resolve_token_ids(proposed, is_accepted, candidates) == [[10, 11, 92], [93], [20, 95]]
