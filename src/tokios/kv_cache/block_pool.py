"""The pool of KV cache blocks: reference counts, a free queue in LRU order, and the map from
chained block hashes to cached blocks.

Pure Python on ints (no torch): the scheduler and tests drive it with exact block ids.

A block is in exactly one of three states:
  - in use: ref_count > 0 (held by one or more requests; shared prefixes have ref_count > 1);
  - cached: ref_count == 0, in the free queue, and still registered under its hash, so a later
    request with the same prefix can take it back without recomputing;
  - free: ref_count == 0, in the free queue, no hash.
Allocation takes from the front of the free queue (least recently freed first) and evicts the
block's hash if it had one. Requests free their blocks tail first, so the end of a prompt is
evicted before its shared beginning.
"""

from __future__ import annotations

from collections import OrderedDict

from tokios.kv_cache.events import CacheEventLog


class NoFreeBlocksError(RuntimeError):
    """Raised by get_new_blocks when the pool cannot satisfy the request (callers check first)."""


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[int | None] = [None] * num_blocks
        # block id -> None, oldest first: an ordered set with O(1) removal from the middle.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.num_evictions = 0
        # With a disk tier (kv_cache/disk_tier.py): (block id, cache key) of every cached block
        # evicted since the last take_evicted(), whose bytes are still in the block until the
        # step that reuses it runs.
        self.record_evictions = False
        self._evicted: list[tuple[int, object]] = []
        # Kept as a count (not recomputed by scanning the free queue) so that stats() from another
        # thread never iterates a structure the engine thread is changing.
        self._num_cached_free = 0
        # What enters and leaves hash_to_block, for a router outside the process (kv_cache/events.py).
        self.cache_events = CacheEventLog()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free or cached, ref_count 0)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref_count 0 that still hold a reusable prefix."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self.free_queue)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self.free_queue.popitem(last=False)
            if self.block_hashes[block_id] is not None:
                self._num_cached_free -= 1
                if self.record_evictions:
                    self._evicted.append((block_id, self.block_hashes[block_id]))
            self._evict_hash(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def _evict_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            self.block_hashes[block_id] = None
            if self.hash_to_block.get(block_hash) == block_id:
                del self.hash_to_block[block_hash]
                self.cache_events.record_removed(block_hash)
            self.num_evictions += 1

    def uncache(self, block_id: int) -> None:
        """Drop a block's hash without counting an eviction (its bytes were never the tokens')."""
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        self.block_hashes[block_id] = None
        if self.hash_to_block.get(block_hash) == block_id:
            del self.hash_to_block[block_hash]
            self.cache_events.record_removed(block_hash)
        if self.ref_counts[block_id] == 0:
            self._num_cached_free -= 1

    def take_evicted(self) -> list[tuple[int, object]]:
        evicted, self._evicted = self._evicted, []
        return evicted

    def cached_blocks(self) -> list[tuple[int, object]]:
        """(block id, cache key) of every block registered in the cache, in use or free."""
        return [(block_id, key) for block_id, key in enumerate(self.block_hashes) if key is not None]

    def get_cached_block(self, block_hash: int) -> int | None:
        return self.hash_to_block.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on blocks found in the cache (reviving them if they were free)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
                if self.block_hashes[block_id] is not None:
                    self._num_cached_free -= 1
            self.ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block under its chained hash."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash in self.hash_to_block:
            return  # an identical block is already cached; this one stays private
        self.block_hashes[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        self.cache_events.record_stored(block_hash)

    def free_blocks(self, block_ids_in_eviction_order: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail in
        the given order (so the first one given is evicted first)."""
        for block_id in block_ids_in_eviction_order:
            count = self.ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            self.ref_counts[block_id] = count
            if count == 0:
                self.free_queue[block_id] = None
                if self.block_hashes[block_id] is not None:
                    self._num_cached_free += 1

    def reset_prefix_cache(self) -> None:
        for block_id in self.free_queue:
            self._evict_hash(block_id)
        self._num_cached_free = 0

    def check_invariants(self, expect_idle: bool = False) -> None:
        """Raise AssertionError-free RuntimeError on inconsistent state. With expect_idle, every
        block must be free or cached with ref_count 0 (nothing leaked)."""
        problems = []
        for block_id, count in enumerate(self.ref_counts):
            if count < 0:
                problems.append(f"block {block_id} has ref_count {count}")
            if (count == 0) != (block_id in self.free_queue):
                problems.append(f"block {block_id}: ref_count {count} but in_free_queue={block_id in self.free_queue}")
            if expect_idle and count != 0:
                problems.append(f"block {block_id} still referenced ({count}) with no request running")
        for block_hash, block_id in self.hash_to_block.items():
            if self.block_hashes[block_id] != block_hash:
                problems.append(f"hash map points at block {block_id}, which holds another hash")
        num_cached_free = sum(1 for block_id in self.free_queue if self.block_hashes[block_id] is not None)
        if num_cached_free != self._num_cached_free:
            problems.append(f"cached-block count {self._num_cached_free} but {num_cached_free} cached blocks are free")
        if problems:
            raise RuntimeError("KV block pool invariant violated: " + "; ".join(problems[:10]))
