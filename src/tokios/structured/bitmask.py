"""GrammarBitmask: the token masks of a step's constrained rows, filled while the model runs.

Owned by the model runner. Before the forward it hands the constrained sequences' matchers (and,
for a verify, their proposals) to one worker thread, which fills an int32 bitmask on the host, one
bit per token (llguidance releases the GIL, so this overlaps the forward); after the forward the
runner applies the mask to those rows' logits (-inf where the grammar forbids the token), before
the sampler's penalties, temperature and truncation: the sampler and the rejection sampler then
see exactly the distribution the grammar allows. EOS is in the mask exactly when the grammar can
end here.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokios.structured.compiler import MASK_BUCKETS_S, SecondsHistogram
from tokios.structured.matcher import GrammarMatcher

BITS_PER_WORD = 32


class GrammarBitmask:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self.num_words = (vocab_size + BITS_PER_WORD - 1) // BITS_PER_WORD
        self._host: torch.Tensor | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._bit_positions = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
        # Host seconds per step spent filling masks (all constrained rows of the step together).
        self.mask_seconds = SecondsHistogram(MASK_BUCKETS_S)

    def start(self, jobs: list[tuple[GrammarMatcher, list[int]]]) -> Future:
        """Begin filling the masks of `jobs` (a matcher and its proposals each: 1 + len(proposals)
        rows, in order). The future's result is the [rows, words] int32 host bitmask."""
        num_rows = sum(1 + len(proposals) for _, proposals in jobs)
        if self._host is None or self._host.shape[0] < num_rows:
            capacity = max(num_rows, 2 * self._host.shape[0] if self._host is not None else 16)
            self._host = torch.empty((capacity, self.num_words), dtype=torch.int32,
                                     pin_memory=self.device.type == "cuda")
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokios-grammar-mask")
        return self._executor.submit(self._fill, jobs, self._host[:num_rows])

    def _fill(self, jobs: list[tuple[GrammarMatcher, list[int]]], bitmask: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        row = 0
        for matcher, proposals in jobs:
            row += matcher.fill_mask(bitmask, row, proposals)
        self.mask_seconds.observe(time.perf_counter() - started)
        return bitmask

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """logits[rows[i]] = -inf wherever bit token of bitmask[i] is 0 (in place)."""
        mask = bitmask.to(self.device, non_blocking=True)
        allowed = ((mask.unsqueeze(-1) >> self._bit_positions) & 1).bool()
        allowed = allowed.reshape(len(rows), -1)[:, :logits.shape[1]]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
