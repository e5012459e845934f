"""Proposers: guess the next few tokens of a request cheaply, for the target to verify.

One interface (Proposer.propose(requests, num_tokens) -> proposed token ids per request) and
three implementations:

- NgramProposer (prompt lookup): match the last n tokens (n from max_n down to min_n) against
  the request's earlier tokens (prompt and output) and propose what followed the latest match.
  No model: a per-request index from each n-gram to its latest end position, extended with the
  new tokens each step (NgramIndex). Strong when the output copies its input (edits, summaries,
  code rewrites), silent otherwise.
- ModelDraftProposer with the target itself (self-draft, early exit): the target's first
  num_layers layers + its final norm + its lm head, greedy. It shares the target's KV cache for
  those layers: layer l's K/V at a position depends only on layers <= l and the tokens up to
  it, and the verify pass computes those rows with the same decode kernels, so it rewrites the
  drafted slots with the same values (and is right whatever the draft left there).
- ModelDraftProposer with a separate draft model (--draft-model): its own weights and its own
  KV cache tensors, addressed with the target's block ids (same slots, no second allocator).
  It catches up lazily: per request it remembers how many positions of its cache are valid and
  first runs the tokens it has not seen (the prompt, the correction token) as one chunk.

Model drafts are greedy, so their q is a point mass at the proposed token (exact under the
rejection rule whatever the request's sampling settings). Proposals are written only into slots
the scheduler reserved (num_spec_slots), never past them.

Talks to: Request (reads tokens), the model (forward with num_layers, compute_logits) and the
runner's batch builder (build_batch) for model drafts. Used by speculative/speculator.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tokios.errors import InvalidRequestError
from tokios.request import Request


class Proposer(Protocol):
    method: str

    def propose(self, requests: list[Request], num_tokens: list[int],
                block_tables: list[list[list[int]]]) -> list[list[int]]:
        """Up to num_tokens[i] proposed token ids for requests[i], which is decoding: its last
        token (all_token_ids[-1]) is not computed yet and is verified in the same pass.
        block_tables[i]: the blocks (a table per KV group) the scheduler gave requests[i] this step."""

    def on_verified(self, request: Request) -> None:
        """After Scheduler.update rolled back rejected positions (request.num_computed_tokens)."""

    def drop(self, request_id: str) -> None:
        """The request left the engine."""


class NgramIndex:
    """The latest end position of every n-gram (min_n <= n <= max_n) of one request's growing token
    list, so a lookup costs O(max_n) instead of a scan of the whole context: a scan in Python took
    milliseconds per request per step on long contexts, and a request with no match is never
    switched off (nothing is proposed, so nothing is verified)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.num_indexed = 0  # end positions [0, num_indexed) are in last_end
        self.last_end: dict[tuple[int, ...], int] = {}

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix."""
        num_tokens = len(token_ids)
        if num_tokens - 1 < self.num_indexed:  # the list shrank: start over
            self.num_indexed, self.last_end = 0, {}
        # Index every end position but the last (the suffix must not match itself), in bulk: later
        # ends overwrite earlier ones, so each n-gram keeps its latest end. Measured: an 8,000-token
        # prompt indexes in about 5 ms once; a step then costs about 15 us (a scan of the list costs 4 ms).
        stop = num_tokens - 1
        for n in range(self.min_n, self.max_n + 1):
            start = max(self.num_indexed, n - 1)
            if start < stop:
                segment = token_ids[start - n + 1:stop]
                grams = zip(*(segment[i:] for i in range(n)))
                self.last_end.update(zip(grams, range(start, stop)))
        self.num_indexed = max(self.num_indexed, stop)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            end = self.last_end.get(tuple(token_ids[num_tokens - n:]))
            if end is not None:
                return token_ids[end + 1:end + 1 + k]
        return []


class NgramProposer:
    method = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise InvalidRequestError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}",
                                      param="ngram_max_n")
        self.min_n = min_n
        self.max_n = max_n
        self.request_to_index: dict[str, NgramIndex] = {}

    def propose(self, requests: list[Request], num_tokens: list[int],
                block_tables: list[list[list[int]]]) -> list[list[int]]:
        proposals = []
        for request, k in zip(requests, num_tokens):
            index = self.request_to_index.get(request.request_id)
            if index is None:
                index = self.request_to_index[request.request_id] = NgramIndex(self.min_n, self.max_n)
            proposals.append(index.lookup(request.all_token_ids, k))
        return proposals

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """One-off lookup (a fresh index): what followed the latest earlier occurrence of the
        longest matching suffix."""
        return NgramIndex(self.min_n, self.max_n).lookup(token_ids, k)

    def on_verified(self, request: Request) -> None:
        pass

    def drop(self, request_id: str) -> None:
        self.request_to_index.pop(request_id, None)


@dataclass
class _DraftView:
    """What the runner's batch builder reads of a request, for one draft pass."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: object


@dataclass
class _DraftCache:
    num_valid_tokens: int = 0  # positions whose draft K/V are right (the request's own tokens)
    num_preemptions: int = 0


class ModelDraftProposer:
    """Greedy drafts from a model over a KV cache addressed by the target's block ids.

    shares_target_cache: True for self-draft (the target computed every earlier position of the
    draft's layers itself), False for a separate draft model (it catches up on its own)."""

    def __init__(self, method: str, model, kv_caches, num_layers: int | None, build_batch, block_size: int,
                 shares_target_cache: bool):
        self.method = method
        self.model = model
        self.kv_caches = kv_caches
        self.num_layers = num_layers
        self.build_batch = build_batch
        self.block_size = block_size
        self.shares_target_cache = shares_target_cache
        self.request_to_cache: dict[str, _DraftCache] = {}

    def _cache(self, request: Request) -> _DraftCache:
        cache = self.request_to_cache.setdefault(request.request_id, _DraftCache())
        if self.shares_target_cache or cache.num_preemptions != request.num_preemptions:
            # Self-draft: the target wrote every computed position. After a preemption the blocks
            # changed: a separate draft recomputes from the start.
            cache.num_valid_tokens = request.num_computed_tokens if self.shares_target_cache else 0
            cache.num_preemptions = request.num_preemptions
        return cache

    @torch.inference_mode()
    def propose(self, requests: list[Request], num_tokens: list[int],
                block_tables: list[list[list[int]]]) -> list[list[int]]:
        proposed: list[list[int]] = [[] for _ in requests]
        caches = [self._cache(r) for r in requests]
        for step in range(max(num_tokens, default=0)):
            active = [i for i, k in enumerate(num_tokens) if k > step]
            views = []
            for i in active:
                request = requests[i]
                token_ids = request.all_token_ids + proposed[i]
                # Everything not yet in the draft's cache up to the newest token, as one chunk.
                start = caches[i].num_valid_tokens
                views.append((_DraftView(request.request_id, token_ids, start, [], request.num_prompt_tokens,
                                         request.sampling_params), len(token_ids) - start, block_tables[i]))
            batch = self.build_batch(views)
            sample_rows = [rows[-1] for rows in batch.entry_rows]
            hidden = self.model.forward(batch.input_ids, batch.positions, batch.metadata, self.kv_caches,
                                        num_layers=self.num_layers)
            next_ids = self.model.compute_logits(hidden[sample_rows]).argmax(dim=-1).tolist()
            for i, token_id in zip(active, next_ids):
                proposed[i].append(token_id)
                caches[i].num_valid_tokens = len(requests[i].all_token_ids) + len(proposed[i]) - 1
        return proposed

    def on_verified(self, request: Request) -> None:
        cache = self.request_to_cache.get(request.request_id)
        if cache is not None:
            cache.num_valid_tokens = min(cache.num_valid_tokens, request.num_computed_tokens)

    def drop(self, request_id: str) -> None:
        self.request_to_cache.pop(request_id, None)


def check_tokenizers_compatible(target_tokenizer, draft_tokenizer, target_vocab_size: int,
                                draft_vocab_size: int, draft_path: str) -> None:
    """A draft's token ids must mean the same strings as the target's, or its proposals are noise
    (and could be out of the target's range)."""
    if draft_vocab_size > target_vocab_size:
        raise InvalidRequestError(
            f"draft model {draft_path} has a vocabulary of {draft_vocab_size} tokens, larger than the target's "
            f"{target_vocab_size}; its tokenizer must be the target's", param="draft_model")
    ids = list(range(draft_vocab_size))
    target_tokens = target_tokenizer.convert_ids_to_tokens(ids)
    draft_tokens = draft_tokenizer.convert_ids_to_tokens(ids)
    for token_id, (target_token, draft_token) in enumerate(zip(target_tokens, draft_tokens)):
        if target_token != draft_token:
            raise InvalidRequestError(
                f"draft model {draft_path} has an incompatible tokenizer: token id {token_id} is {draft_token!r} "
                f"for the draft but {target_token!r} for the target", param="draft_model")
