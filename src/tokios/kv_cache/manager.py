"""The KV cache manager: which blocks each request holds, prefix-cache lookups, copy on write.

Pure Python (no torch). The scheduler asks three things of it:
  get_computed_blocks(request)  -> the longest cached prefix of full blocks (prefix caching);
  allocate_slots(request, n)    -> room for n more tokens, or None when the pool cannot give it;
  free(request)                 -> give the request's blocks back, tail first;
  truncate(request, n)          -> keep only the blocks holding the first n tokens (speculative
                                   decoding rolls back rejected positions with it).
Block identity for prefix caching is a chained hash: hash(parent block's hash, this block's
token ids), where the first block's parent is the cache salt (model, tokenizer and chat
template), so blocks are only shared between requests whose whole prefix matches.

Writes into a block that another request also holds (a forked sample re-writing its last
prompt token, see fork) are copy-on-write: allocate_slots returns the (source, destination)
block pairs the runner must copy before the step.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

from tokios.kv_cache.block_pool import BlockPool


class CacheRequest(Protocol):
    request_id: str
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


def chain_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """128-bit hash of a block given its parent's hash (collisions are practically impossible,
    unlike Python's 64-bit tuple hash, and stable across processes)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash.to_bytes(16, "little"))
    digest.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return int.from_bytes(digest.digest(), "little")


def salt_hash(cache_salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(cache_salt.encode(), digest_size=16).digest(), "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: str = ""):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.root_hash = salt_hash(cache_salt)
        self.request_to_blocks: dict[str, list[int]] = {}
        self.request_to_hashes: dict[str, list[int]] = {}
        self.request_to_num_cached_blocks: dict[str, int] = {}  # full blocks registered in the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ---- hashing -------------------------------------------------------------------------
    def _block_hashes(self, request: CacheRequest, num_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks among its first num_tokens tokens,
        extended incrementally (each block is hashed once per request)."""
        hashes = self.request_to_hashes.setdefault(request.request_id, [])
        token_ids = request.all_token_ids
        bs = self.block_size
        for index in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else self.root_hash
            hashes.append(chain_hash(parent, token_ids[index * bs:(index + 1) * bs]))
        return hashes

    # ---- the scheduler's interface ---------------------------------------------------------
    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[int], int]:
        """Longest cached prefix: (block ids, number of tokens they hold). At least one token is
        always left to compute, because the step must produce logits at the last position."""
        if not self.enable_prefix_caching:
            return [], 0
        num_tokens = len(request.all_token_ids)
        max_blocks = (num_tokens - 1) // self.block_size
        hit_blocks: list[int] = []
        for block_hash in self._block_hashes(request, max_blocks * self.block_size):
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += len(hit_blocks) * self.block_size
        return hit_blocks, len(hit_blocks) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Could a request of num_tokens ever fit, with the whole pool to itself?"""
        return -(-num_tokens // self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[tuple[int, int]] | None:
        """Make room for num_new_tokens after the request's computed tokens (plus computed_blocks,
        the prefix-cache hit of a request being admitted). Returns the copy-on-write pairs
        (source block, destination block) the runner must copy first, or None without side
        effects when the pool is short."""
        bs = self.block_size
        blocks = self.request_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * bs
        total_tokens = num_computed + num_new_tokens
        num_held = len(blocks) + len(computed_blocks)
        num_new_blocks = max(0, -(-total_tokens // bs) - num_held)
        # Blocks this step writes into that someone else also holds must be copied first.
        shared_indices = [i for i in range(num_computed // bs, len(blocks)) if self.pool.ref_counts[blocks[i]] > 1]
        num_revived = sum(1 for b in computed_blocks if self.pool.ref_counts[b] == 0)
        if num_new_blocks + len(shared_indices) + num_revived > self.pool.num_free_blocks:
            return None
        if computed_blocks:
            self.pool.touch(list(computed_blocks))
            blocks = list(computed_blocks) + blocks
            self.request_to_num_cached_blocks[request.request_id] = len(computed_blocks)
        copies = []
        for index in shared_indices:
            (destination,) = self.pool.get_new_blocks(1)
            copies.append((blocks[index], destination))
            self.pool.free_blocks([blocks[index]])
            blocks[index] = destination
        blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        self.request_to_blocks[request.request_id] = blocks
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, total_tokens)
        return copies

    def _cache_full_blocks(self, request: CacheRequest, blocks: list[int], num_tokens: int) -> None:
        # Blocks are registered when allocated for tokens that this step computes: within a step
        # every layer writes all new K/V before attending, so a second request admitted in the
        # same step may already share them.
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.request_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full * self.block_size)
        for index in range(start, num_full):
            self.pool.cache_block(blocks[index], hashes[index])
        self.request_to_num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        """Let child share the parent's blocks holding its first num_tokens tokens (n > 1
        samples of one prompt). A later write into a shared block is copied on write."""
        shared = self.request_to_blocks[parent.request_id][:-(-num_tokens // self.block_size)]
        self.pool.touch(shared)
        self.request_to_blocks[child.request_id] = list(shared)
        num_full = num_tokens // self.block_size
        self.request_to_hashes[child.request_id] = list(self.request_to_hashes.get(parent.request_id, [])[:num_full])
        self.request_to_num_cached_blocks[child.request_id] = min(
            num_full, self.request_to_num_cached_blocks.get(parent.request_id, 0))

    def free(self, request: CacheRequest) -> None:
        blocks = self.request_to_blocks.pop(request.request_id, [])
        self.request_to_hashes.pop(request.request_id, None)
        self.request_to_num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def truncate(self, request: CacheRequest, num_tokens: int) -> list[int]:
        """Keep the blocks that hold the request's first num_tokens tokens and free the rest,
        tail first; returns the freed block ids. Speculative decoding calls it after a
        verification step rejected positions: their KV entries are never attended again (a
        kept partial block's stale slots lie past the request's context length and are
        overwritten by the next write). Freed blocks were never registered in the prefix cache:
        allocate_slots only hashes blocks whose tokens are all accepted (request.all_token_ids
        never holds provisional tokens)."""
        blocks = self.request_to_blocks.get(request.request_id)
        if blocks is None:
            return []
        num_kept = -(-num_tokens // self.block_size)
        freed = blocks[num_kept:]
        if not freed:
            return []
        del blocks[num_kept:]
        num_cached = self.request_to_num_cached_blocks.get(request.request_id, 0)
        if num_cached > num_kept:
            self.request_to_num_cached_blocks[request.request_id] = num_kept
        self.pool.free_blocks(list(reversed(freed)))
        return freed

    def block_ids(self, request_id: str) -> list[int]:
        return self.request_to_blocks.get(request_id, [])

    def check_invariants(self, expect_idle: bool = False) -> None:
        self.pool.check_invariants(expect_idle=expect_idle)
        if expect_idle and self.request_to_blocks:
            raise RuntimeError(f"KV blocks still mapped to requests: {sorted(self.request_to_blocks)}")
