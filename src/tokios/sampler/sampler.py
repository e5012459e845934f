"""The sampler: one next token per row of logits, for a batch of requests with different settings.

Order of operations (also in docs/sampling.md), each batched over rows:

1. penalties: repetition (tokens seen in prompt + output; divide positive / multiply negative
   logits, as HF and vLLM), then frequency and presence (subtract freq * count + presence *
   (count > 0) over output tokens, as OpenAI);
2. min_tokens: EOS and stop token ids get -inf while the output is shorter than min_tokens;
3. logit_bias added;
4. temperature (greedy rows, temperature < 1e-5 or top_k == 1, take the argmax here instead);
5. truncation: top-k, then top-p on the top-k distribution, then min-p;
6. the draw: exact inverse-CDF sampling with one uniform per row; seeded rows draw their uniform
   from their own torch.Generator, so a seed gives the same tokens whatever else is in the batch.

Logprobs are reported from the raw distribution (log_softmax of the unprocessed logits), as the
OpenAI API does. The fast path: a batch that is all greedy and edits no logits is a plain argmax.

Talks to: SamplingMetadata (built by the runner each step), ops.py (the maths). The speculative
rejection sampler reuses `compute_processed_probs` (steps 1-5) and `ops.sample_from_probs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokios.sampler import ops
from tokios.sampler.metadata import SamplingMetadata


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_requests] long
    # [num_requests] float32, under the raw distribution; None when no row asked for logprobs (a
    # log-sum-exp over the vocabulary per row, 2% of a 16-row decode step, that nobody would read).
    sampled_logprobs: torch.Tensor | None
    # Only when some row asked for logprobs; K = the largest `logprobs` in the batch (rows that
    # asked for fewer slice their prefix). Ranks: 1 = the most likely token.
    top_logprob_ids: torch.Tensor | None = None  # [num_requests, K] long
    top_logprobs: torch.Tensor | None = None  # [num_requests, K] float32
    sampled_token_ranks: torch.Tensor | None = None  # [num_requests] long
    # [num_requests] bool: False where the row had nothing to sample (nan logits from the model, or
    # settings that removed every token); that row's token is meaningless and its request must
    # fail alone (docs/reliability.md). None only from callers that build outputs by hand.
    row_is_valid: torch.Tensor | None = None


def apply_logit_edits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 1-3 (penalties, min_tokens suppression, bias). Returns `logits` itself when the batch
    edits nothing, otherwise a new tensor: the raw logits stay intact for logprobs."""
    if not metadata.edits_logits:
        return logits
    edited = logits
    if metadata.prompt_token_mask is not None:
        seen_mask = metadata.prompt_token_mask | (metadata.output_token_counts > 0)
        edited = ops.apply_repetition_penalty(edited, seen_mask, metadata.repetition_penalty)
    if metadata.frequency_penalty is not None:
        edited = ops.apply_frequency_presence_penalties(
            edited, metadata.output_token_counts, metadata.frequency_penalty, metadata.presence_penalty
        )
    if edited is logits:
        edited = logits.clone()
    if metadata.suppressed_rows is not None:
        ops.suppress_tokens_(edited, metadata.suppressed_rows, metadata.suppressed_token_ids)
    if metadata.bias_rows is not None:
        ops.add_logit_bias_(edited, metadata.bias_rows, metadata.bias_token_ids, metadata.bias_values)
    return edited


def apply_temperature_and_truncation(edited_logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 4-5 on the output of apply_logit_edits; meaningful for the random rows only."""
    # Model logits, frequency/presence penalties (|2 x count|) and biases (|100|) stay far below
    # FLOAT32_MAX * 1e-5; only a repetition penalty can push a logit towards FLOAT32_MAX (where
    # ops.apply_repetition_penalty saturates it), so only then can the division overflow.
    logits = ops.apply_temperature(edited_logits, metadata.temperature,
                                   may_overflow=metadata.repetition_penalty is not None)
    if metadata.top_k is None and metadata.top_p is None and metadata.min_p is None:
        return logits
    # Narrow-first candidate search only where a host sync is free; on accelerators one full sort.
    initial = ops.CPU_INITIAL_NUM_TOP_P_CANDIDATES if logits.device.type == "cpu" else None
    if metadata.top_p is None:
        initial = 1  # top-k / min-p alone need max_top_k (or 1) candidates, never a search
    return ops.apply_truncation(logits, metadata.top_k, metadata.max_top_k, metadata.top_p, metadata.min_p, initial)


def compute_processed_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row's token is drawn from (steps 1-5): [rows, vocab] float32.
    Greedy rows get a one-hot at their argmax, so rejection sampling treats them exactly. A row
    with nothing to sample has no positive finite mass (all zeros, or nan)."""
    edited = apply_logit_edits(logits.float(), metadata)
    if metadata.all_greedy:
        return _one_hot_argmax(edited)
    probs = apply_temperature_and_truncation(edited, metadata).softmax(dim=-1)
    if metadata.is_greedy_row is not None:
        probs = torch.where(metadata.is_greedy_row.unsqueeze(1), _one_hot_argmax(edited), probs)
    return probs


def greedy_tokens(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax, and whether the row had one: a row that is all -inf (everything
    suppressed) or holds a nan (torch's max propagates it) has none. One pass, like argmax."""
    values, token_ids = logits.max(dim=-1)
    return token_ids, values > ops.NEG_INF


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """A one-hot at each row's argmax; all zeros for a row without one (see greedy_tokens), so a
    caller's `probs.sum(-1) > 0` finds invalid greedy rows as it finds invalid random ones."""
    token_ids, row_is_valid = greedy_tokens(logits)
    one_hot = torch.zeros_like(logits)
    return one_hot.scatter_(1, token_ids.unsqueeze(1), row_is_valid.to(logits.dtype).unsqueeze(1))


class Sampler:
    """Callable: `sampler(logits [num_requests, vocab], metadata) -> SamplerOutput`.

    `shared_generator` drives the rows without a seed (None: torch's default generator); it must be
    on the logits' device.
    """

    def __init__(self, shared_generator: torch.Generator | None = None):
        self.shared_generator = shared_generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape != (metadata.num_requests, metadata.vocab_size):
            raise ValueError(
                f"logits must be [{metadata.num_requests}, {metadata.vocab_size}], got {tuple(logits.shape)}"
            )
        raw_logits = logits.float()
        if metadata.is_plain_greedy:
            sampled_token_ids, row_is_valid = greedy_tokens(raw_logits)
        else:
            sampled_token_ids, row_is_valid = self._sample(raw_logits, metadata)
        return self._with_logprobs(raw_logits, sampled_token_ids, row_is_valid, metadata)

    def _sample(self, raw_logits: torch.Tensor, metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        edited = apply_logit_edits(raw_logits, metadata)
        if metadata.all_greedy:
            return greedy_tokens(edited)
        probs = apply_temperature_and_truncation(edited, metadata).softmax(dim=-1)
        uniforms = ops.draw_uniforms(metadata.generators, raw_logits.device, self.shared_generator)
        sampled_token_ids, row_is_valid = ops.sample_from_probs(probs, uniforms, return_validity=True)
        if metadata.is_greedy_row is not None:
            greedy_ids, greedy_is_valid = greedy_tokens(edited)
            sampled_token_ids = torch.where(metadata.is_greedy_row, greedy_ids, sampled_token_ids)
            row_is_valid = torch.where(metadata.is_greedy_row, greedy_is_valid, row_is_valid)
        return sampled_token_ids, row_is_valid

    @staticmethod
    def _with_logprobs(
        raw_logits: torch.Tensor, sampled_token_ids: torch.Tensor, row_is_valid: torch.Tensor,
        metadata: SamplingMetadata
    ) -> SamplerOutput:
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids, None, row_is_valid=row_is_valid)
        raw_logprobs = raw_logits.log_softmax(dim=-1)
        sampled_logprobs, ranks, top_ids, top_logprobs = ops.gather_logprobs(
            raw_logprobs, sampled_token_ids, metadata.max_num_logprobs
        )
        return SamplerOutput(sampled_token_ids, sampled_logprobs, top_ids, top_logprobs, ranks, row_is_valid)
