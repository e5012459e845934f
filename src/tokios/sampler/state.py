"""Per-request sampling state the model runner keeps between steps.

Owns what must persist across steps so that building a step's SamplingMetadata costs
O(batch + new tokens) on the host instead of O(batch x sequence length):

- the request's torch.Generator (seeded requests only), so its draws continue one stream;
- for requests with penalties, one row in two device tables kept by SamplingStateStore:
  `output_token_counts[row, token_id]` (int32, how often each token was generated) and
  `prompt_token_mask[row, token_id]` (bool, only for repetition penalty). A step gathers the rows
  of the batch with one index_select; new output tokens are folded in with one index_put_ for the
  whole batch. Row 0 is never handed out and stays all zeros: requests without penalties point at
  it, so the penalty maths runs unchanged (and as a no-op) on their rows.

Choice documented in docs/sampling.md: tables grow by doubling (a copy, rare) rather than being
sized for max_num_seqs up front, because most batches use no penalties and then no table exists.

Talks to: SamplingParams (input), tokios.sampler.metadata (reads these states each step). Used by
the runner: `store.add(...)` when a request joins, `store.remove(state)` when it finishes.
"""

from __future__ import annotations

import torch

from tokios.errors import InvalidRequestError
from tokios.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed` (negative seeds are mapped as torch maps them)."""
    return torch.Generator(device=device).manual_seed(seed)


class RequestSamplingState:
    """What the sampler remembers about one request. Create through SamplingStateStore.add."""

    def __init__(
        self,
        params: SamplingParams,
        generator: torch.Generator | None,
        stop_suppression_token_ids: frozenset[int],
        penalty_row: int,
        prompt_token_ids: list[int],
    ):
        self.params = params
        self.generator = generator
        self.stop_suppression_token_ids = stop_suppression_token_ids
        # Stored sorted once so each step can extend flat index lists without re-sorting.
        self.sorted_stop_suppression_token_ids = sorted(stop_suppression_token_ids)
        self.penalty_row = penalty_row
        self.prompt_token_ids = prompt_token_ids
        self.num_counted_output_tokens = 0
        bias = params.logit_bias or {}
        self.logit_bias_token_ids = list(bias.keys())
        self.logit_bias_values = list(bias.values())

    @property
    def is_greedy(self) -> bool:
        return self.params.is_greedy


class SamplingStateStore:
    """Owns the penalty tables for all live requests of one runner (one device, one vocab)."""

    def __init__(self, vocab_size: int, device: torch.device | str, initial_num_rows: int = 8):
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._initial_num_rows = max(2, initial_num_rows)
        # [num_rows, vocab] int32; allocated when the first request with penalties arrives.
        self.output_token_counts: torch.Tensor | None = None
        # [num_rows, vocab] bool; allocated when the first request with repetition penalty arrives.
        self.prompt_token_mask: torch.Tensor | None = None
        self._free_rows: list[int] = []
        self._num_rows = 0

    def add(
        self,
        params: SamplingParams,
        prompt_token_ids: list[int],
        stop_suppression_token_ids: frozenset[int] = frozenset(),
        generator: torch.Generator | None = None,
    ) -> RequestSamplingState:
        """Register a request. `stop_suppression_token_ids` are the EOS ids plus stop_token_ids that
        min_tokens holds back. A seeded, non-greedy request gets its own generator unless one is given."""
        # Out-of-range ids would fail inside index_put_ (a device-side assert on CUDA).
        params.validate_for_vocab(self.vocab_size)
        if generator is None and params.seed is not None and not params.is_greedy:
            generator = make_generator(params.seed, self.device)
        penalty_row = 0
        if params.has_penalties:
            penalty_row = self._take_row()
            if params.has_repetition_penalty:
                self._mark_prompt(penalty_row, prompt_token_ids)
        return RequestSamplingState(params, generator, frozenset(stop_suppression_token_ids), penalty_row, prompt_token_ids)

    def remove(self, state: RequestSamplingState) -> None:
        """Release the request's table row; call when the request finishes or is aborted."""
        if state.penalty_row:
            self._clear_row(state.penalty_row)
            self._free_rows.append(state.penalty_row)
            state.penalty_row = 0

    def fold_new_output_tokens(self, states: list[RequestSamplingState], output_token_ids: list[list[int]]) -> None:
        """Add tokens generated since the last call to the count table: one index_put_ per step."""
        rows: list[int] = []
        token_ids: list[int] = []
        for state, output in zip(states, output_token_ids):
            if not state.penalty_row:
                continue
            if len(output) < state.num_counted_output_tokens:
                # The output shrank (a rollback); recount this request from scratch.
                self.output_token_counts[state.penalty_row].zero_()
                state.num_counted_output_tokens = 0
            new_token_ids = output[state.num_counted_output_tokens :]
            if new_token_ids:
                rows.extend([state.penalty_row] * len(new_token_ids))
                token_ids.extend(new_token_ids)
                state.num_counted_output_tokens = len(output)
        if token_ids:
            if max(token_ids) >= self.vocab_size:
                raise ValueError(f"output token id {max(token_ids)} is outside the vocab of {self.vocab_size}")
            index = torch.tensor([rows, token_ids], dtype=torch.long).to(self.device, non_blocking=True)
            ones = torch.ones(len(token_ids), dtype=torch.int32, device=self.device)
            self.output_token_counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def _mark_prompt(self, row: int, prompt_token_ids: list[int]) -> None:
        if self.prompt_token_mask is None:
            self.prompt_token_mask = torch.zeros(
                self.output_token_counts.shape, dtype=torch.bool, device=self.device
            )
        if not prompt_token_ids:
            return
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size - 1}]", param="prompt"
            )
        ids = torch.tensor(prompt_token_ids, dtype=torch.long).to(self.device)
        self.prompt_token_mask[row].index_fill_(0, ids, True)

    def _take_row(self) -> int:
        if self.output_token_counts is None:
            self._grow(self._initial_num_rows)
        if not self._free_rows:
            self._grow(2 * self._num_rows)
        return self._free_rows.pop()

    def _grow(self, num_rows: int) -> None:
        counts = torch.zeros((num_rows, self.vocab_size), dtype=torch.int32, device=self.device)
        if self.output_token_counts is not None:
            counts[: self._num_rows] = self.output_token_counts
        self.output_token_counts = counts
        if self.prompt_token_mask is not None:
            mask = torch.zeros((num_rows, self.vocab_size), dtype=torch.bool, device=self.device)
            mask[: self._num_rows] = self.prompt_token_mask
            self.prompt_token_mask = mask
        # Row 0 stays the shared all-zero row; hand out low rows first.
        first_new_row = max(self._num_rows, 1)
        self._free_rows.extend(reversed(range(first_new_row, num_rows)))
        self._num_rows = num_rows

    def _clear_row(self, row: int) -> None:
        self.output_token_counts[row].zero_()
        if self.prompt_token_mask is not None:
            self.prompt_token_mask[row].zero_()
