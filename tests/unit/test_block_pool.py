"""BlockPool with exact block ids: allocation order, reference counts, the LRU free queue,
the hash -> block map, eviction, and the invariant checker itself."""

from __future__ import annotations

import pytest

from tokios.kv_cache.block_pool import BlockPool, NoFreeBlocksError


def free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order they would be handed out (evicted) next."""
    return list(pool.free_queue)


def test_fresh_pool_hands_out_lowest_ids_first():
    pool = BlockPool(6)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.get_new_blocks(3) == [2, 3, 4]
    assert pool.ref_counts == [1, 1, 1, 1, 1, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (1, 5)
    pool.check_invariants()


def test_asking_for_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    assert free_order(pool) == [2]
    assert pool.ref_counts == [1, 1, 0]
    pool.check_invariants()


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = BlockPool(5)
    pool.get_new_blocks(4)  # 0 1 2 3, block 4 stays free
    pool.free_blocks([3, 1])
    assert free_order(pool) == [4, 3, 1]
    assert pool.get_new_blocks(2) == [4, 3]
    pool.check_invariants()


def test_shared_block_is_free_only_after_its_last_reference():
    pool = BlockPool(3)
    (block_id,) = pool.get_new_blocks(1)
    pool.touch([block_id])
    assert pool.ref_counts[block_id] == 2
    pool.free_blocks([block_id])
    assert block_id not in pool.free_queue
    pool.free_blocks([block_id])
    assert pool.ref_counts[block_id] == 0 and free_order(pool) == [1, 2, 0]
    pool.check_invariants(expect_idle=True)


def test_freeing_more_often_than_taken_is_refused():
    pool = BlockPool(2)
    (block_id,) = pool.get_new_blocks(1)
    pool.free_blocks([block_id])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([block_id])
    assert pool.ref_counts[block_id] == 0
    pool.check_invariants(expect_idle=True)


def test_cached_block_stays_findable_after_free_and_is_revived_by_touch():
    pool = BlockPool(4)
    (block_id,) = pool.get_new_blocks(1)
    pool.cache_block(block_id, 0xABC)
    pool.free_blocks([block_id])
    assert pool.get_cached_block(0xABC) == block_id
    assert pool.num_cached_blocks == 1 and pool.num_free_blocks == 4
    pool.touch([block_id])  # a later request with the same prefix takes it back
    assert pool.ref_counts[block_id] == 1 and block_id not in pool.free_queue
    assert pool.num_cached_blocks == 0  # counted as used now, still registered
    assert pool.get_cached_block(0xABC) == block_id
    pool.check_invariants()


def test_allocation_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(4)
    a, b, c, d = pool.get_new_blocks(4)
    for block_id, block_hash in ((a, 100), (b, 101), (c, 102)):
        pool.cache_block(block_id, block_hash)
    pool.free_blocks([c, a])  # c freed before a: c is the older entry
    pool.free_blocks([b])
    assert free_order(pool) == [c, a, b]
    assert pool.get_new_blocks(1) == [c]
    assert pool.get_cached_block(102) is None and c not in pool.hash_to_block.values()
    assert pool.num_evictions == 1
    assert pool.get_cached_block(100) == a and pool.get_cached_block(101) == b
    assert pool.get_new_blocks(2) == [a, b]
    assert pool.hash_to_block == {} and pool.num_evictions == 3
    pool.free_blocks([a, b, c, d])
    pool.check_invariants(expect_idle=True)


def test_touching_a_cached_block_moves_it_out_of_the_eviction_line():
    pool = BlockPool(3)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([a, b, c])
    pool.touch([a])  # reused: must not be evicted while held
    assert pool.get_new_blocks(2) == [b, c]
    assert pool.get_cached_block(1) == a and pool.get_cached_block(2) is None
    pool.free_blocks([a, b, c])
    assert free_order(pool) == [a, b, c]  # freed again: a goes to the tail like any other
    pool.check_invariants(expect_idle=True)


def test_duplicate_hash_keeps_the_first_block_and_leaves_the_second_private():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 7)
    pool.cache_block(second, 7)
    assert pool.get_cached_block(7) == first
    assert pool.block_hashes[second] is None
    pool.free_blocks([first, second])
    assert pool.num_cached_blocks == 1
    pool.check_invariants(expect_idle=True)


def test_caching_disabled_registers_and_finds_nothing():
    pool = BlockPool(2, enable_caching=False)
    (block_id,) = pool.get_new_blocks(1)
    pool.cache_block(block_id, 5)
    assert pool.get_cached_block(5) is None and pool.block_hashes[block_id] is None


def test_reset_prefix_cache_drops_only_unreferenced_hashes():
    pool = BlockPool(3)
    a, b, _ = pool.get_new_blocks(3)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) == b
    pool.check_invariants()


def test_invariant_checker_catches_a_leak_and_a_corrupt_free_queue():
    pool = BlockPool(3)
    pool.get_new_blocks(1)
    pool.check_invariants()  # a held block is fine while a request runs
    with pytest.raises(RuntimeError, match="still referenced"):
        pool.check_invariants(expect_idle=True)
    pool.free_queue[0] = None  # corrupt: held and free at once
    with pytest.raises(RuntimeError, match="in_free_queue"):
        pool.check_invariants()


def test_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
