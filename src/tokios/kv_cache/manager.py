"""The KV cache manager: which blocks each request holds, prefix-cache lookups, copy on write.

Pure Python (no torch). The scheduler asks three things of it:
  get_computed_blocks(request)  -> the longest cached prefix of full blocks (prefix caching);
  allocate_slots(request, n)    -> room for n more tokens, or None when the pool cannot give it;
  free(request)                 -> give the request's blocks back, tail first;
  truncate(request, n)          -> keep only the blocks holding the first n tokens (speculative
                                   decoding rolls back rejected positions with it).
A model with sliding-window layers has several KV groups (kv_cache/layout.py), each with its own
block table per request, all drawing from the one pool; a sliding group's blocks are freed as
they fall out of its window. Block identity for prefix caching is a chained hash: hash(parent block's hash, this block's
token ids), where the first block's parent is the cache salt (model, tokenizer and chat
template), so blocks are only shared between requests whose whole prefix matches.

Writes into a block that another request also holds (a forked sample re-writing its last
prompt token, see fork) are copy-on-write: allocate_slots returns the (source, destination)
block pairs the runner must copy before the step.

With a disk tier (kv_cache/disk_tier.py), a prefix lookup goes on past the memory hit into the
blocks on disk: each is read (and verified) at once into a newly taken block, and the runner
writes its bytes into the cache before the step (take_transfers: loads). A cached block evicted
to make room is written to disk from the bytes it still holds when the step starts (spills).
"""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

from tokios.kv_cache.block_pool import BlockPool
from tokios.kv_cache.layout import KVCacheGroup, KVCacheLayout


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


NULL_BLOCK = -1  # a block-table entry a sliding-window group has freed (never read again)


def cache_key(group: int, block_hash: int) -> int | tuple[int, int]:
    """The key a group's copy of a block is cached under: every group caches its own copy (its
    own layers' K/V) of the same tokens; group 0's key is the hash itself."""
    return block_hash if group == 0 else (group, block_hash)


def tail_key(group: int, tail_hash: int) -> tuple[str, int, int]:
    """The key a finished request's last, partly filled block is cached under: the chained hash
    of the tokens it holds (fewer than a block's). Only a partial lookup finds it (a full block's
    hash always covers a whole block); it never goes to disk or into the cache events."""
    return ("tail", group, tail_hash)


def is_tail_key(key: object) -> bool:
    return type(key) is tuple and len(key) == 3


def split_cache_key(key: int | tuple[int, int]) -> tuple[int, int]:
    """(group, block hash) of a cache key (the runner and the disk tier read keys with it)."""
    return (0, key) if isinstance(key, int) else key


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: str = "", layout: KVCacheLayout | None = None, disk=None, block_payload_bytes: int = 0):
        """disk: a DiskPrefixCache (or None); block_payload_bytes: the bytes of one block of one
        KV group (what a disk file must hold)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.layout = layout or KVCacheLayout.for_windows((None,))
        self.groups = self.layout.groups
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.root_hash = salt_hash(cache_salt)
        self.request_to_blocks: dict[str, list[list[int]]] = {}  # per request: one block table per group
        self.request_to_hashes: dict[str, list[int]] = {}
        self.request_to_num_cached_blocks: dict[str, int] = {}  # full blocks registered in the cache
        # Every cached block of group 0 under its parent's hash: (parent hash, its key, its token
        # ids), full blocks and finished requests' partly filled last blocks (tail_key) alike, so
        # that a lookup whose next block differs part way, or ends in a block never filled, can
        # reuse the tokens before the difference (_partial_block). Kept by block id: at most one
        # entry a block.
        self._block_to_entry: dict[int, tuple[int, object, tuple[int, ...]]] = {}
        # (parent hash, first token id) -> the blocks below that parent that start with it.
        self._parent_to_blocks: dict[tuple[int, int], set[int]] = {}
        # Blocks whose bytes this scheduling pass's step has yet to write (registered for tokens it
        # computes, or the destination of a copy): shared whole they are fine (every layer writes
        # before it attends), but copied they are not (copies run before the step). Cleared at
        # the end of each pass (take_transfers).
        self._unwritten_blocks: set[int] = set()
        # Cached blocks this pass copies part of into a request's own block: held until the pass
        # ends, so that they keep their bytes until the runner has copied them.
        self._lent_blocks: list[int] = []
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found (in memory or on disk)
        self.disk = disk if enable_prefix_caching else None
        self.block_payload_bytes = block_payload_bytes
        self.disk_hits = 0  # tokens loaded from disk
        self.pool.record_evictions = self.disk is not None
        # Blocks read from disk this step: (block id, cache key, payload); each holds a reference
        # until take_transfers(), so nothing can take it before the runner has written it.
        self._loads: list[tuple[int, object, bytes]] = []

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

    def _first_needed_block(self, group: KVCacheGroup, num_tokens: int) -> int:
        """The first block a query at position num_tokens still reads in this group."""
        return group.first_needed_position(num_tokens) // self.block_size

    # ---- the scheduler's interface ---------------------------------------------------------
    def get_computed_blocks(self, request: CacheRequest) -> tuple[list[list[int]], int]:
        """Longest cached prefix: (a block table per group, number of tokens they hold). At least
        one token is always left to compute, because the step must produce logits at the last
        position. A full-attention group needs every block of the prefix cached; a sliding one
        only the blocks its window still reads (the earlier entries are NULL_BLOCK), so the hit
        is the longest prefix every group can serve."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups], 0
        num_tokens = len(request.all_token_ids)
        max_blocks = (num_tokens - 1) // self.block_size
        hashes = self._block_hashes(request, max_blocks * self.block_size)
        cached = [[self.pool.get_cached_block(cache_key(g, h)) for h in hashes] for g in range(len(self.groups))]
        on_disk = [[block is None and self.disk is not None and cache_key(g, h) in self.disk
                    for block, h in zip(cached[g], hashes)] for g in range(len(self.groups))]
        while True:
            num_hit = self._servable_prefix(cached, on_disk, max_blocks)
            if self._load_from_disk(cached, on_disk, hashes, num_hit):
                break
        tables = []
        for g, group in enumerate(self.groups):
            first = self._first_needed_block(group, num_hit * self.block_size) if num_hit else 0
            tables.append([NULL_BLOCK] * first + cached[g][first:num_hit])
        num_hit_tokens = num_hit * self.block_size
        if num_hit_tokens < num_tokens - 1:  # the next block may still match in part
            num_matching, partial_blocks = self._partial_block(request, hashes[:num_hit], num_tokens)
            if num_matching:
                for table, block_id in zip(tables, partial_blocks):
                    table.append(block_id)
                num_hit_tokens += num_matching
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return tables, num_hit_tokens

    def _partial_block(self, request: CacheRequest, hashes: list[int], num_tokens: int) -> tuple[int, list[int]]:
        """After the full-block hit: a cached block, child of the hit's last block, whose first
        tokens are the request's next ones: (how many match, its block in each group), or (0, []).
        The request takes a copy of it (allocate_slots), so a conversation whose next turn
        differs from what was computed part way through a block recomputes only from the first
        differing token, not from the block's start. At least one token is left to compute."""
        bs = self.block_size
        start = len(hashes) * bs
        token_ids = request.all_token_ids[start:min(start + bs - 1, num_tokens - 1)]
        parent = hashes[-1] if hashes else self.root_hash
        best, best_blocks = 0, []
        # The caller looks only when a token is left past the full blocks: token_ids is not empty.
        for block_id in list(self._parent_to_blocks.get((parent, token_ids[0]), ())):
            _, key, cached_ids = self._block_to_entry[block_id]
            if self.pool.block_hashes[block_id] != key:
                self._forget_block(block_id)  # evicted or re-used since
                continue
            num_matching = 0
            for cached_id, token_id in zip(cached_ids, token_ids):
                if cached_id != token_id:
                    break
                num_matching += 1
            if num_matching <= best:
                continue
            blocks = [self.pool.get_cached_block(tail_key(g, key[2]) if is_tail_key(key) else cache_key(g, key))
                      for g in range(len(self.groups))]
            if all(block is not None and block not in self._unwritten_blocks for block in blocks):
                best, best_blocks = num_matching, blocks
        return best, best_blocks

    def _remember_block(self, block_id: int, parent: int, key: object, token_ids: Sequence[int]) -> None:
        self._forget_block(block_id)
        self._block_to_entry[block_id] = (parent, key, tuple(token_ids))
        self._parent_to_blocks.setdefault((parent, token_ids[0]), set()).add(block_id)

    def _forget_block(self, block_id: int) -> None:
        entry = self._block_to_entry.pop(block_id, None)
        if entry is not None:
            index_key = (entry[0], entry[2][0])
            siblings = self._parent_to_blocks[index_key]
            siblings.discard(block_id)
            if not siblings:
                del self._parent_to_blocks[index_key]

    def _servable_prefix(self, cached: list[list[int | None]], on_disk: list[list[bool]], max_blocks: int) -> int:
        """The most leading blocks every group can serve, from memory or from disk."""
        num_hit = max_blocks
        while True:  # shrink until every group can serve the same prefix (0 always can)
            before = num_hit
            for g, group in enumerate(self.groups):
                first = self._first_needed_block(group, num_hit * self.block_size)
                while num_hit and any(block is None and not disk
                                      for block, disk in zip(cached[g][first:num_hit], on_disk[g][first:num_hit])):
                    num_hit -= 1
                    first = self._first_needed_block(group, num_hit * self.block_size)
            if num_hit == before:
                return num_hit

    def _load_from_disk(self, cached, on_disk, hashes: list[int], num_hit: int) -> bool:
        """Read the disk blocks the first num_hit blocks need into new blocks (cached[g][i] set).
        False when one could not be (a bad file, no free block): it is marked unavailable and
        the caller looks for a shorter prefix."""
        for i in range(num_hit):
            for g, group in enumerate(self.groups):
                if i < self._first_needed_block(group, num_hit * self.block_size) or cached[g][i] is not None:
                    continue
                key = cache_key(g, hashes[i])
                payload = self.disk.read(key, self.block_payload_bytes) if self.pool.num_free_blocks else None
                if payload is None:
                    on_disk[g][i] = False
                    return False
                (block_id,) = self.pool.get_new_blocks(1)
                self.pool.cache_block(block_id, key)
                self._loads.append((block_id, key, payload))
                self.disk_hits += self.block_size if g == 0 else 0
                cached[g][i] = block_id
        return True

    def take_transfers(self) -> tuple[list[tuple[int, object]], list[tuple[int, object, bytes]]]:
        """Since the last call: (block id, cache key) of cached blocks evicted, whose bytes the
        runner writes to disk before the step, and (block id, cache key, payload) of blocks read
        from disk, which it writes into the cache after those. Drops the references the loaded
        blocks held. The scheduler calls it once at the end of every pass."""
        self._unwritten_blocks.clear()  # the pass is over: its step writes them before the next
        self.pool.free_blocks(self._lent_blocks)  # its step copies them first
        self._lent_blocks = []
        spills = ([spill for spill in self.pool.take_evicted() if not is_tail_key(spill[1])]
                  if self.disk is not None else [])
        loads, self._loads = self._loads, []
        self.pool.free_blocks([block_id for block_id, _, _ in loads])
        return spills, loads

    def cached_block_keys(self) -> list[tuple[int, object]]:
        """(block id, cache key) of every block in the memory cache (what shutdown writes to disk)."""
        return [(block_id, key) for block_id, key in self.pool.cached_blocks() if not is_tail_key(key)]

    def uncache_uncomputed(self, request: CacheRequest) -> None:
        """Take out of the cache the request's blocks registered for tokens it has not computed
        (it was scheduled this step and then preempted before the step ran): their bytes are not
        the tokens' K/V and must never be found by a prefix lookup, in memory or on disk."""
        first = request.num_computed_tokens // self.block_size
        for table in self.request_to_blocks.get(request.request_id, []):
            for block_id in table[first:]:
                if block_id != NULL_BLOCK and self.pool.ref_counts[block_id] == 1:
                    self.pool.uncache(block_id)
        num_cached = self.request_to_num_cached_blocks.get(request.request_id, 0)
        self.request_to_num_cached_blocks[request.request_id] = min(num_cached, first)

    def blocks_for_tokens(self, num_tokens: int, max_chunk_tokens: int | None = None) -> int:
        """Blocks, all groups together, that num_tokens tokens of one request hold at most: a
        sliding group at most its window plus one step's chunk (max_chunk_tokens, default all)."""
        bs = self.block_size
        needed = 0
        for group in self.groups:
            held = num_tokens
            if group.window is not None:
                held = min(num_tokens, group.window + (max_chunk_tokens or num_tokens) + bs)
            needed += -(-held // bs)
        return needed

    def free_blocks_to_hold(self, request: CacheRequest, computed_blocks: Sequence[Sequence[int]] = (),
                            num_hit_tokens: int | None = None) -> int:
        """Free blocks the request's whole token list would take, starting from computed_blocks (a
        prefix hit of num_hit_tokens, default all its blocks): a hit block another request holds
        costs nothing, an idle cached one leaves the free pool like a new block; a block the hit
        ends part way through is copied, a new block like any other."""
        num_lent = 1 if num_hit_tokens is not None and num_hit_tokens % self.block_size else 0
        shared = sum(1 for table in computed_blocks for b in table[:len(table) - num_lent]
                     if b != NULL_BLOCK and self.pool.ref_counts[b] > 0)
        return self.blocks_for_tokens(request.num_tokens) - self.num_held_blocks(request) - shared

    def num_held_blocks(self, request: CacheRequest) -> int:
        return sum(1 for table in self.request_to_blocks.get(request.request_id, ()) for b in table if b != NULL_BLOCK)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def can_fit(self, num_tokens: int, max_chunk_tokens: int | None = None) -> bool:
        """Could a request of num_tokens ever fit, with the whole pool to itself?"""
        return self.blocks_for_tokens(num_tokens, max_chunk_tokens) <= self.pool.num_blocks

    def max_request_tokens(self, max_chunk_tokens: int | None = None) -> int:
        """The longest request can_fit allows (with a sliding group, more than the pool's slots
        per group: such a group keeps only its window)."""
        low, high = 0, self.pool.num_blocks * self.block_size
        while low < high:
            middle = (low + high + 1) // 2
            if self.can_fit(middle, max_chunk_tokens):
                low = middle
            else:
                high = middle - 1
        return low

    def _free_out_of_window(self, tables: list[list[int]], num_computed: int) -> None:
        """Give back the blocks a sliding group no longer reads: its next query is at num_computed."""
        for group, table in zip(self.groups, tables):
            if group.window is None:
                continue
            # Freed entries are always a prefix of the table: walk back from the window's edge to
            # it, so a step costs the blocks it frees, not the whole context.
            freed = []
            index = min(self._first_needed_block(group, num_computed), len(table)) - 1
            while index >= 0 and table[index] != NULL_BLOCK:
                freed.append(table[index])
                table[index] = NULL_BLOCK
                index -= 1
            if freed:
                self.pool.free_blocks(freed[::-1])  # oldest first: evicted first

    def allocate_slots(self, request: CacheRequest, num_new_tokens: int,
                       computed_blocks: Sequence[Sequence[int]] = (),
                       register_blocks: bool = True, num_hit_tokens: int | None = None) -> list[tuple[int, int]] | None:
        """Make room for num_new_tokens after the request's computed tokens (plus computed_blocks,
        the prefix-cache hit of a request being admitted: one block table per group, holding
        num_hit_tokens tokens, default all of its blocks; a hit that ends part way through its
        last block gets a copy of that block, as the request writes the rest of it). Returns
        the copy-on-write pairs (source block, destination block) the runner must copy first, or
        None when the pool is short (then nothing changed but blocks no query reads any more).
        register_blocks=False: the step does not finish the new tokens (a layer slice that is
        not the chunk's last), so their full blocks stay out of the prefix cache until a later
        call, with the same count, registers them."""
        bs = self.block_size
        num_groups = len(self.groups)
        tables = self.request_to_blocks.get(request.request_id) or [[] for _ in self.groups]
        computed_blocks = [list(c) for c in computed_blocks] or [[] for _ in self.groups]
        if num_hit_tokens is None:
            num_hit_tokens = len(computed_blocks[0]) * bs
        num_computed = request.num_computed_tokens + num_hit_tokens
        total_tokens = num_computed + num_new_tokens
        if request.request_id in self.request_to_blocks:
            self._free_out_of_window(tables, num_computed)
        # A hit ending part way through a block: that block is someone else's cached block.
        partial = [hit.pop() if num_hit_tokens % bs else None for hit in computed_blocks]
        needed = 0
        shared: list[list[int]] = []
        for g in range(num_groups):
            table, hit = tables[g], computed_blocks[g]
            needed += max(0, -(-total_tokens // bs) - len(table) - len(hit))
            # Blocks this step writes into that someone else also holds must be copied first.
            shared.append([i for i in range(num_computed // bs, len(table))
                           if table[i] != NULL_BLOCK and self.pool.ref_counts[table[i]] > 1])
            needed += len(shared[-1]) + sum(1 for b in hit if b != NULL_BLOCK and self.pool.ref_counts[b] == 0)
            needed += partial[g] is not None and self.pool.ref_counts[partial[g]] == 0
        if needed > self.pool.num_free_blocks:
            for hit, block_id in zip(computed_blocks, partial):
                if block_id is not None:
                    hit.append(block_id)
            return None
        if any(computed_blocks) or num_hit_tokens:
            self.request_to_num_cached_blocks[request.request_id] = num_hit_tokens // bs
        # Every group's hit blocks and lent blocks are held before any group takes a new block:
        # a cached block nobody holds is in the free queue, and a new block for one group must
        # not be another group's hit (groups' blocks share the one pool and the same memory).
        for g in range(num_groups):
            hit = computed_blocks[g]
            if hit or partial[g] is not None:
                self.pool.touch([b for b in hit if b != NULL_BLOCK])
                tables[g] = hit + tables[g]
            if partial[g] is not None:
                # Held until the pass ends (take_transfers): the runner copies it before the step,
                # and nothing this pass takes (a new block, a disk load) may be it.
                self.pool.touch([partial[g]])
                self._lent_blocks.append(partial[g])
        copies = []
        for g in range(num_groups):
            if partial[g] is not None:
                (destination,) = self.pool.get_new_blocks(1)
                copies.append((partial[g], destination))
                self._unwritten_blocks.add(destination)
                tables[g].insert(len(computed_blocks[g]), destination)
            table = tables[g]
            for index in shared[g]:
                (destination,) = self.pool.get_new_blocks(1)
                copies.append((table[index], destination))
                self.pool.free_blocks([table[index]])
                table[index] = destination
            table.extend(self.pool.get_new_blocks(max(0, -(-total_tokens // bs) - len(table))))
        self.request_to_blocks[request.request_id] = tables
        if self.enable_prefix_caching and register_blocks:
            self._cache_full_blocks(request, tables, total_tokens)
        return copies

    def _cache_full_blocks(self, request: CacheRequest, tables: list[list[int]], num_tokens: int) -> None:
        # Blocks are registered when allocated for tokens that this step computes: within a step
        # every layer writes all new K/V before attending, so a second request admitted in the
        # same step may already share them.
        num_full = min(num_tokens, len(request.all_token_ids)) // self.block_size
        start = self.request_to_num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full * self.block_size)
        bs = self.block_size
        for g, table in enumerate(tables):
            for index in range(start, num_full):
                if table[index] != NULL_BLOCK:
                    self.pool.cache_block(table[index], cache_key(g, hashes[index]))
                    self._unwritten_blocks.add(table[index])
                    if g == 0 and self.pool.block_hashes[table[index]] == hashes[index]:
                        self._remember_block(table[index], hashes[index - 1] if index else self.root_hash,
                                             hashes[index], request.all_token_ids[index * bs:(index + 1) * bs])
        self.request_to_num_cached_blocks[request.request_id] = num_full

    def fork(self, parent: CacheRequest, child: CacheRequest, num_tokens: int) -> None:
        """Let child share the parent's blocks holding its first num_tokens tokens (n > 1
        samples of one prompt). A later write into a shared block is copied on write."""
        num_blocks = -(-num_tokens // self.block_size)
        tables = [list(table[:num_blocks]) for table in self.request_to_blocks[parent.request_id]]
        self.pool.touch([b for table in tables for b in table if b != NULL_BLOCK])
        self.request_to_blocks[child.request_id] = tables
        num_full = num_tokens // self.block_size
        self.request_to_hashes[child.request_id] = list(self.request_to_hashes.get(parent.request_id, [])[:num_full])
        self.request_to_num_cached_blocks[child.request_id] = min(
            num_full, self.request_to_num_cached_blocks.get(parent.request_id, 0))

    def _cache_tail(self, request: CacheRequest, tables: list[list[int]]) -> None:
        """Keep a leaving request's last, partly filled block findable (tail_key): the next turn of
        a conversation re-sends these tokens and parts from them inside this block (the answer's
        end), which no full block ever held. Only a block the request holds alone, and only the
        tokens it computed."""
        bs = self.block_size
        num_full, num_in_tail = divmod(request.num_computed_tokens, bs)
        if not num_in_tail or any(len(table) <= num_full for table in tables):
            return
        blocks = [table[num_full] for table in tables]
        if any(block == NULL_BLOCK or self.pool.ref_counts[block] != 1 or self.pool.block_hashes[block] is not None
               or block in self._unwritten_blocks for block in blocks):
            return
        # The hash list may run past the computed tokens (the lookup hashed the whole prompt).
        hashes = self._block_hashes(request, num_full * bs)
        parent = hashes[num_full - 1] if num_full else self.root_hash
        token_ids = request.all_token_ids[num_full * bs:request.num_computed_tokens]
        tail_hash = chain_hash(parent, token_ids)
        for g, block in enumerate(blocks):
            self.pool.cache_block(block, tail_key(g, tail_hash))
        if self.pool.block_hashes[blocks[0]] == tail_key(0, tail_hash):
            self._remember_block(blocks[0], parent, tail_key(0, tail_hash), token_ids)

    def free(self, request: CacheRequest) -> None:
        tables = self.request_to_blocks.get(request.request_id, [])
        if self.enable_prefix_caching and tables:
            self._cache_tail(request, tables)
        self.request_to_blocks.pop(request.request_id, None)
        self.request_to_hashes.pop(request.request_id, None)
        self.request_to_num_cached_blocks.pop(request.request_id, None)
        for table in tables:
            self.pool.free_blocks([b for b in reversed(table) if b != NULL_BLOCK])

    def truncate(self, request: CacheRequest, num_tokens: int) -> list[int]:
        """Keep the blocks that hold the request's first num_tokens tokens and free the rest,
        tail first; returns the freed block ids. Speculative decoding calls it after a
        verification step rejected positions: their KV entries are never attended again (a
        kept partial block's stale slots lie past the request's context length and are
        overwritten by the next write). Freed blocks were never registered in the prefix cache:
        allocate_slots only hashes blocks whose tokens are all accepted (request.all_token_ids
        never holds provisional tokens)."""
        tables = self.request_to_blocks.get(request.request_id)
        if tables is None:
            return []
        num_kept = -(-num_tokens // self.block_size)
        all_freed = []
        for table in tables:
            freed = [b for b in table[num_kept:] if b != NULL_BLOCK]
            del table[num_kept:]
            self.pool.free_blocks(list(reversed(freed)))
            all_freed.extend(freed)
        num_cached = self.request_to_num_cached_blocks.get(request.request_id, 0)
        if all_freed and num_cached > num_kept:
            self.request_to_num_cached_blocks[request.request_id] = num_kept
        return all_freed

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's block table in one group (NULL_BLOCK where a sliding group freed one)."""
        tables = self.request_to_blocks.get(request_id)
        return tables[group] if tables else []

    def block_tables(self, request_id: str) -> list[list[int]]:
        """One block table per group (kv_cache/layout.py), what the runner addresses slots by."""
        return self.request_to_blocks.get(request_id) or [[] for _ in self.groups]

    def check_invariants(self, expect_idle: bool = False) -> None:
        self.pool.check_invariants(expect_idle=expect_idle)
        if expect_idle and self.request_to_blocks:
            raise RuntimeError(f"KV blocks still mapped to requests: {sorted(self.request_to_blocks)}")
