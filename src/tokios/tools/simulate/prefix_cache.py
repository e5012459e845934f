"""One backend's prefix cache: which shared system prompts it holds in its KV blocks.

Owns `PrefixCache`: prefix id -> its number of blocks and the running requests using it. A prefix
in use is pinned; once no request uses it, it stays cached but evictable, least recently used
first, as vLLM's free-block queue and tokios' block pool (kv_cache/block_pool.py) evict cached
blocks only when a new request needs the room. backend.py does the block accounting around it and
asks it to evict; the optional `on_evict(prefix_id)` lets the prefix-aware router forget the
backend as a holder.

Only shared system prompts are tracked: a request's own prompt and output never match another
request's, so caching them would change no hit, only the order of evictions (see docs/scale-out.md).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class PrefixCache:
    def __init__(self, on_evict: Callable[[int], None] | None = None):
        self.prefix_id_to_num_blocks: dict[int, int] = {}
        self.prefix_id_to_num_users: dict[int, int] = {}
        self.evictable: OrderedDict[int, int] = OrderedDict()  # unused prefixes, least recent first
        self.num_cached_blocks = 0
        self.num_evictable_blocks = 0
        self.num_evictions = 0
        self.on_evict = on_evict

    def __contains__(self, prefix_id: int) -> bool:
        return prefix_id in self.prefix_id_to_num_blocks

    def num_blocks(self, prefix_id: int) -> int:
        """Blocks a hit on `prefix_id` would reuse (0: not cached)."""
        return self.prefix_id_to_num_blocks.get(prefix_id, 0)

    def is_evictable(self, prefix_id: int) -> bool:
        return prefix_id in self.evictable

    def insert(self, prefix_id: int, num_blocks: int) -> None:
        """A request has just computed this prefix: its blocks join the cache, pinned by it."""
        self.prefix_id_to_num_blocks[prefix_id] = num_blocks
        self.prefix_id_to_num_users[prefix_id] = 1
        self.num_cached_blocks += num_blocks

    def pin(self, prefix_id: int) -> None:
        if self.evictable.pop(prefix_id, None) is not None:
            self.num_evictable_blocks -= self.prefix_id_to_num_blocks[prefix_id]
        self.prefix_id_to_num_users[prefix_id] += 1

    def unpin(self, prefix_id: int) -> None:
        self.prefix_id_to_num_users[prefix_id] -= 1
        if self.prefix_id_to_num_users[prefix_id] == 0:
            num_blocks = self.prefix_id_to_num_blocks[prefix_id]
            self.evictable[prefix_id] = num_blocks  # most recently used: evicted last
            self.num_evictable_blocks += num_blocks

    def evict(self, num_blocks_needed: int) -> int:
        """Drop least recently used unpinned prefixes until `num_blocks_needed` blocks are freed
        (or none is left); returns the blocks freed."""
        freed = 0
        while freed < num_blocks_needed and self.evictable:
            prefix_id, num_blocks = self.evictable.popitem(last=False)
            del self.prefix_id_to_num_blocks[prefix_id]
            del self.prefix_id_to_num_users[prefix_id]
            self.num_cached_blocks -= num_blocks
            self.num_evictable_blocks -= num_blocks
            self.num_evictions += 1
            freed += num_blocks
            if self.on_evict is not None:
                self.on_evict(prefix_id)
        return freed
