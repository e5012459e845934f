"""GrammarMatcher: one sequence's position in its grammar.

The scheduler advances it with every token appended to the sequence (Request.append_token), so
its state is always "after the sequence's output so far". The runner reads it to fill that row's
token mask; for a verify row j of a speculative step it consumes the first j proposals, fills the
mask and rolls them back. The speculator keeps only the proposals the grammar accepts. Not
thread-safe: the engine thread uses it, except while the runner's mask worker fills masks during
the model's forward, when the engine thread leaves it alone.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("tokios.structured")


class GrammarMatcher:
    def __init__(self, matcher, description: str):
        self._matcher = matcher  # llguidance.LLMatcher, this sequence's own copy
        self.description = description  # e.g. "json", for logs

    def accept(self, token_id: int) -> bool:
        """Advance by one generated token; False (and an error logged) if the grammar refuses it,
        which the mask makes impossible unless the mask and the sequence went out of step."""
        if self._matcher.consume_token(token_id):
            return True
        logger.error("the %s grammar refused token %d: %s", self.description, token_id, self._matcher.get_error())
        return False

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits nothing more (only EOS): the sequence can stop."""
        return self._matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self._matcher.is_accepting()

    def valid_prefix(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of proposed tokens the grammar would accept from here."""
        if not token_ids:
            return token_ids
        return token_ids[:self._matcher.validate_tokens(token_ids)]

    def fill_mask(self, bitmask: torch.Tensor, row: int, proposals: list[int] = ()) -> int:
        """Fill rows row .. row + len(proposals) of `bitmask` (int32 [rows, words], on the host):
        row + j is the mask after the first j proposals. Proposals past the first one the grammar
        refuses get the refusing row's mask (they are never emitted: the rejection sampler stops at
        the refused one). Returns how many rows it filled."""
        num_consumed = 0
        for j in range(len(proposals) + 1):
            target = bitmask[row + j]
            self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
            if j == len(proposals):
                break
            if not self._matcher.try_consume_tokens([proposals[j]]):
                bitmask[row + j + 1:row + len(proposals) + 1] = target
                break
            num_consumed += 1
        if num_consumed:
            self._matcher.rollback(num_consumed)
        return len(proposals) + 1
