"""Exact verification of proposed tokens: the standard speculative rejection rule.

For a request with proposed tokens x_1..x_k (drawn from the draft distributions q_1..q_k) the
target model scores k + 1 rows in one pass: row j holds p_j, the target's processed distribution
(penalties, bias, temperature, top-k/p, min-p: sampler.compute_processed_probs) for the token
after x_1..x_j. Then, position by position:

  accept x_j with probability min(1, p_j(x_j) / q_j(x_j));
  at the first rejection, emit one token from normalize(max(0, p_j - q_j)) and stop;
  if all k are accepted, emit a bonus token from p_k.

Every emitted token is then distributed exactly as plain sampling from the target would draw it
(Leviathan et al. 2023; Chen et al. 2023). A proposer that picks its tokens deterministically
(n-gram lookup, a greedy draft) has a point mass q = one_hot(x_j): x_j is accepted with
probability p_j(x_j) and a rejection draws from p_j without x_j. Greedy requests have a one-hot
p_j, so the rule reduces to "accept while the argmax matches, then emit the argmax".

Layout: rows of one request are consecutive (its k + 1 verify rows, in position order); a
request without proposals has one row and simply samples from p. Random numbers come from the
request's own generator when it is seeded (metadata.generators), else from the shared one.

Talks to: sampler (compute_processed_probs, ops.draw_uniforms / sample_from_probs); used by the
model runner, which turns the tensors into token ids with its one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokios.sampler import SamplingMetadata, compute_processed_probs, draw_uniforms, greedy_tokens, sample_from_probs


@dataclass
class VerifyOutput:
    is_accepted: torch.Tensor  # [num_proposed] bool, one per proposed token, request order
    candidate_token_ids: torch.Tensor  # [num_rows] long: the token emitted if verification stops at this row
    # [num_rows] bool: False where the target distribution had nothing to sample (nan logits, or
    # every token removed); the runner fails that row's request alone. None: all valid.
    row_is_valid: torch.Tensor | None = None


def verify_probs(target_probs: torch.Tensor, proposed_rows: torch.Tensor, proposed_token_ids: torch.Tensor,
                 draft_probs: torch.Tensor | None, accept_uniforms: torch.Tensor,
                 draw_uniforms_per_row: torch.Tensor) -> VerifyOutput:
    """The rule on tensors. target_probs [rows, vocab] (need not be normalized per row);
    proposed_rows [P] long: the row whose distribution scores each proposed token;
    proposed_token_ids [P] long; draft_probs [P, vocab] or None (point masses);
    accept_uniforms [P] and draw_uniforms_per_row [rows] in [0, 1)."""
    target_probs = target_probs / target_probs.sum(dim=-1, keepdim=True)
    p_proposed = target_probs[proposed_rows].gather(1, proposed_token_ids[:, None]).squeeze(1)
    if draft_probs is None:
        q_proposed = torch.ones_like(p_proposed)
        draft_rows = torch.zeros(proposed_rows.shape[0], target_probs.shape[1], dtype=target_probs.dtype,
                                 device=target_probs.device).scatter_(1, proposed_token_ids[:, None], 1.0)
    else:
        draft_probs = draft_probs / draft_probs.sum(dim=-1, keepdim=True)
        q_proposed = draft_probs.gather(1, proposed_token_ids[:, None]).squeeze(1)
        draft_rows = draft_probs
    # u < p / q  <=>  u q < p (no division; p = 0 is never accepted, q > 0 for a proposed token).
    is_accepted = accept_uniforms.to(p_proposed.dtype) * q_proposed < p_proposed
    residual = target_probs.clone()
    residual[proposed_rows] = (target_probs[proposed_rows] - draft_rows).clamp_(min=0.0)
    # A row whose residual is empty (p == q) is only reached with probability 0: keep p there so
    # the draw stays well defined.
    is_empty = residual.sum(dim=-1) <= 0
    residual = torch.where(is_empty[:, None], target_probs, residual)
    candidates = sample_from_probs(residual, draw_uniforms_per_row)
    return VerifyOutput(is_accepted, candidates)


@dataclass
class VerifyLayout:
    """Where each request's rows sit in a verify batch: its proposals' rows, then its bonus row."""

    proposal_rows: list[int]  # the row scoring each proposed token, request order
    proposal_token_ids: list[int]  # the proposed tokens, flattened in the same order
    request_first_rows: list[int]  # each request's first row
    num_rows: int

    @classmethod
    def of(cls, proposed_token_ids: list[list[int]]) -> "VerifyLayout":
        proposal_rows, flat, first_rows, row = [], [], [], 0
        for proposed in proposed_token_ids:
            first_rows.append(row)
            proposal_rows.extend(range(row, row + len(proposed)))
            flat.extend(proposed)
            row += len(proposed) + 1
        return cls(proposal_rows, flat, first_rows, row)


def resolve_token_ids(proposed_token_ids: list[list[int]], is_accepted: list[bool],
                      candidate_token_ids: list[int]) -> list[list[int]]:
    """Host side: per request, the accepted prefix of its proposals plus the candidate at the row
    where verification stopped (the correction, or the bonus when all were accepted)."""
    result = []
    proposed_index = 0
    row = 0
    for proposed in proposed_token_ids:
        num_accepted = 0
        while num_accepted < len(proposed) and is_accepted[proposed_index + num_accepted]:
            num_accepted += 1
        result.append(proposed[:num_accepted] + [candidate_token_ids[row + num_accepted]])
        proposed_index += len(proposed)
        row += len(proposed) + 1
    return result


class RejectionSampler:
    """Callable over model logits: `sampler(logits, metadata, layout) -> VerifyOutput`.

    logits [rows, vocab], one metadata row per logits row (the runner repeats a request's
    settings over its verify rows); layout = VerifyLayout.of(proposals, request order), which
    the caller builds once and also uses to read the rows back.
    """

    def __init__(self, shared_generator: torch.Generator | None = None):
        self.shared_generator = shared_generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata, layout: VerifyLayout,
                 draft_probs: torch.Tensor | None = None) -> VerifyOutput:
        device = logits.device
        if layout.num_rows != logits.shape[0]:
            raise ValueError(f"logits have {logits.shape[0]} rows but the proposals need {layout.num_rows}")
        proposed_rows = layout.proposal_rows
        proposed_rows_t = torch.tensor(proposed_rows, dtype=torch.long, device=device)
        proposed_ids_t = torch.tensor(layout.proposal_token_ids, dtype=torch.long, device=device)
        if metadata.is_plain_greedy:
            # Greedy, nothing edits the logits: accept while the argmax matches.
            argmax, row_is_valid = greedy_tokens(logits)
            return VerifyOutput(argmax[proposed_rows_t] == proposed_ids_t, argmax, row_is_valid)
        probs = compute_processed_probs(logits, metadata)
        row_is_valid = probs.sum(dim=-1) > 0  # nan > 0 is False
        row_generators = metadata.generators
        accept_uniforms = draw_uniforms([row_generators[r] for r in proposed_rows], device, self.shared_generator)
        row_uniforms = draw_uniforms(row_generators, device, self.shared_generator)
        output = verify_probs(probs, proposed_rows_t, proposed_ids_t, draft_probs, accept_uniforms, row_uniforms)
        output.row_is_valid = row_is_valid
        return output
