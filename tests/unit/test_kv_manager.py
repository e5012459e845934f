"""KVCacheManager with exact block ids: prefix hits and misses, chained hashes and the salt,
tail-first freeing (LRU eviction order), copy on write after fork, and the invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tokios.kv_cache.layout import KVCacheLayout
from tokios.kv_cache.manager import NULL_BLOCK, KVCacheManager, chain_hash, salt_hash

BLOCK_SIZE = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)  # what admitting it asked to copy


def admit(kv: KVCacheManager, request: FakeRequest, end_pass: bool = True) -> list[int]:
    """What the scheduler does for a new request: prefix lookup, then room for the rest, then
    (end_pass) the end of its scheduling pass. Returns the hit in group 0 (the only group of
    these full-attention managers); a hit that ends part way through a block copies that block,
    one copy per group."""
    hit_tables, num_cached = kv.get_computed_blocks(request)
    hit = list(hit_tables[0])
    request.copies = kv.allocate_slots(request, len(request.all_token_ids) - num_cached, hit_tables,
                                       num_hit_tokens=num_cached)
    assert len(request.copies) == (len(kv.groups) if num_cached % kv.block_size else 0)
    request.num_computed_tokens = len(request.all_token_ids)
    if end_pass:
        kv.take_transfers()  # the scheduling pass ends; its step writes the new blocks
    return hit


def test_prefix_miss_allocates_fresh_blocks_in_order():
    kv = KVCacheManager(8, BLOCK_SIZE)
    request = FakeRequest("a", list(range(10)))
    assert admit(kv, request) == []
    assert kv.block_ids("a") == [0, 1, 2]  # 10 tokens: two full blocks and a partial one
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10, 0)
    kv.check_invariants()


def test_prefix_hit_shares_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(8, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(10))))
    # Same first 8 tokens: blocks 0 and 1 are shared, the rest is new.
    b = FakeRequest("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, b) == [0, 1]
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.ref_counts[:4] == [2, 2, 1, 1]
    assert kv.prefix_cache_hits == 8
    # Exactly 8 tokens, all cached: the last token is recomputed so the step has logits to
    # sample; the 3 before it are copied from the cached block 1 into the request's own block 4.
    c = FakeRequest("c", list(range(8)))
    assert admit(kv, c) == [0, 1]
    assert kv.block_ids("c") == [0, 4] and c.copies == [(1, 4)]
    assert kv.prefix_cache_hits == 8 + 7
    assert kv.pool.ref_counts[:5] == [3, 2, 1, 1, 1]  # block 1 lent its bytes, not a reference
    kv.check_invariants()


def test_a_block_that_differs_part_way_lends_the_tokens_before_the_difference():
    kv = KVCacheManager(8, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(12))))
    kv.free(FakeRequest("a"))
    # The next turn re-sends 9 of a's tokens then differs: its block 2 misses as a whole, and
    # a's block 2 (tokens 8..11) lends token 8.
    b = FakeRequest("b", list(range(9)) + [70, 71, 72, 73, 74, 75, 76])
    assert admit(kv, b) == [0, 1, 2]
    assert kv.block_ids("b")[:2] == [0, 1] and b.copies == [(2, kv.block_ids("b")[2])]
    assert kv.prefix_cache_hits == 9
    # The lender keeps its own tokens: a request that re-sends 10 of them still finds them.
    c = FakeRequest("c", list(range(10)) + [5])
    assert admit(kv, c) == [0, 1, 2] and c.copies == [(2, kv.block_ids("c")[2])]
    assert kv.prefix_cache_hits == 9 + 10
    # Nothing of the next block matches: a plain full-block hit, nothing copied.
    d = FakeRequest("d", list(range(8)) + [90, 91])
    assert admit(kv, d) == [0, 1] and d.copies == []
    kv.check_invariants()


def test_a_partial_hit_in_every_kv_group_of_a_sliding_window_model():
    kv = KVCacheManager(24, BLOCK_SIZE, layout=KVCacheLayout.for_windows((None, 8)))
    admit(kv, FakeRequest("a", list(range(16))))
    kv.free(FakeRequest("a"))
    b = FakeRequest("b", list(range(13)) + [99, 98])
    tables, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 13
    copies = kv.allocate_slots(b, 2, tables, num_hit_tokens=13)
    assert [source for source, _ in copies] == [tables[0][3], tables[1][3]] and len(copies) == 2
    assert [kv.block_tables("b")[g][3] for g in (0, 1)] == [destination for _, destination in copies]
    assert kv.block_tables("b")[1][:1] == [NULL_BLOCK]  # the sliding group reads only its window
    kv.check_invariants()


def test_a_different_first_block_breaks_the_chain_even_when_later_blocks_match():
    kv = KVCacheManager(8, BLOCK_SIZE)
    admit(kv, FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    other = FakeRequest("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(kv, other) == []  # block 2's tokens match, its parent does not
    assert kv.block_ids("b") == [3, 4, 5]


def test_cache_salt_separates_models():
    tokens = list(range(9))
    kv_one = KVCacheManager(4, BLOCK_SIZE, cache_salt="model-1")
    kv_two = KVCacheManager(4, BLOCK_SIZE, cache_salt="model-2")
    assert kv_one.root_hash == salt_hash("model-1") != kv_two.root_hash
    admit(kv_one, FakeRequest("a", tokens))
    first_hash = chain_hash(salt_hash("model-1"), tokens[:4])
    assert kv_one.pool.get_cached_block(first_hash) == 0
    assert chain_hash(salt_hash("model-2"), tokens[:4]) != first_hash


def test_freed_prefix_is_reused_by_a_later_request():
    kv = KVCacheManager(8, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(12))))
    kv.free(FakeRequest("a"))
    kv.check_invariants(expect_idle=True)
    assert kv.pool.num_cached_blocks == 3
    b = FakeRequest("b", list(range(12)) + [99])
    assert admit(kv, b) == [0, 1, 2]  # revived from the free queue
    assert kv.block_ids("b") == [0, 1, 2, 3]
    assert kv.pool.ref_counts[:4] == [1, 1, 1, 1]
    kv.check_invariants()


def test_free_is_tail_first_so_a_prompt_end_is_evicted_before_its_start():
    kv = KVCacheManager(6, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(12))))  # blocks 0 1 2, all full and cached
    kv.free(FakeRequest("a"))
    assert list(kv.pool.free_queue) == [3, 4, 5, 2, 1, 0]
    # Five fresh blocks: the never-used 3 4 5 go first, then a's last block 2, then block 1.
    admit(kv, FakeRequest("b", list(range(100, 120))))
    assert kv.block_ids("b") == [3, 4, 5, 2, 1]
    assert kv.pool.num_evictions == 2
    # Only a's first block survives: a repeat of a's prompt hits one block, not three.
    c = FakeRequest("c", list(range(12)) + [7])
    assert kv.get_computed_blocks(c) == ([[0]], BLOCK_SIZE)
    kv.check_invariants()


def test_allocation_that_does_not_fit_returns_none_without_side_effects():
    kv = KVCacheManager(3, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(8))))
    before = (list(kv.pool.ref_counts), list(kv.pool.free_queue), dict(kv.request_to_blocks))
    big = FakeRequest("b", list(range(50, 59)))
    assert kv.allocate_slots(big, 9) is None
    assert (list(kv.pool.ref_counts), list(kv.pool.free_queue), dict(kv.request_to_blocks)) == before
    kv.check_invariants()


def test_reviving_cached_blocks_counts_against_free_space():
    kv = KVCacheManager(3, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(8))))
    kv.free(FakeRequest("a"))  # blocks 1, 0 cached in the free queue; block 2 free
    b = FakeRequest("b", list(range(8)) + list(range(60, 66)))  # 14 tokens: 4 blocks, only 3 exist
    hit_blocks, num_cached = kv.get_computed_blocks(b)
    assert (hit_blocks, num_cached) == ([[0, 1]], 8)
    assert kv.allocate_slots(b, 6, hit_blocks) is None
    assert kv.pool.ref_counts == [0, 0, 0]
    kv.check_invariants(expect_idle=True)


def test_decode_grows_one_block_when_the_last_is_full():
    kv = KVCacheManager(4, BLOCK_SIZE)
    request = FakeRequest("a", list(range(4)))
    admit(kv, request)
    assert kv.block_ids("a") == [0]
    request.all_token_ids.append(42)  # sampled token, not yet computed
    assert kv.allocate_slots(request, 1) == []
    assert kv.block_ids("a") == [0, 1]
    request.num_computed_tokens += 1
    for token_id in (43, 44, 45):
        request.all_token_ids.append(token_id)
        assert kv.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    assert kv.block_ids("a") == [0, 1]  # positions 4..7 fit in block 1
    # The decoded block is full now, so it is registered for later prefix hits too.
    assert kv.pool.get_cached_block(chain_hash(chain_hash(kv.root_hash, [0, 1, 2, 3]), [42, 43, 44, 45])) == 1


def test_fork_shares_prompt_blocks_and_the_first_write_copies_the_shared_last_block():
    kv = KVCacheManager(6, BLOCK_SIZE)
    parent = FakeRequest("p", list(range(6)))  # blocks 0 (full) and 1 (2 of 4 slots)
    admit(kv, parent)
    child = FakeRequest("c", list(range(6)))
    kv.fork(parent, child, 6)
    assert kv.block_ids("c") == [0, 1]
    assert kv.pool.ref_counts[:2] == [2, 2]
    # The child recomputes the last prompt token (its own logits): a write into shared block 1.
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1) == [(1, 2)]
    assert kv.block_ids("c") == [0, 2] and kv.block_ids("p") == [0, 1]
    assert kv.pool.ref_counts[:3] == [2, 1, 1]
    # Later writes are private: no more copies.
    child.num_computed_tokens = 6
    child.all_token_ids.append(9)
    assert kv.allocate_slots(child, 1) == []
    kv.free(child)
    kv.free(parent)
    kv.check_invariants(expect_idle=True)


def test_fork_on_a_block_boundary_copies_the_full_last_block():
    kv = KVCacheManager(6, BLOCK_SIZE)
    parent = FakeRequest("p", list(range(8)))
    admit(kv, parent)
    child = FakeRequest("c", list(range(8)))
    kv.fork(parent, child, 8)
    child.num_computed_tokens = 7
    assert kv.allocate_slots(child, 1) == [(1, 2)]
    assert kv.pool.ref_counts[:3] == [2, 1, 1]
    kv.free(parent)
    kv.free(child)
    kv.check_invariants(expect_idle=True)


def test_copy_on_write_that_does_not_fit_returns_none():
    kv = KVCacheManager(2, BLOCK_SIZE)
    parent = FakeRequest("p", list(range(6)))
    admit(kv, parent)  # both blocks used
    child = FakeRequest("c", list(range(6)))
    kv.fork(parent, child, 6)
    child.num_computed_tokens = 5
    assert kv.allocate_slots(child, 1) is None
    assert kv.block_ids("c") == [0, 1] and kv.pool.ref_counts == [2, 2]
    kv.free(child)
    kv.free(parent)
    kv.check_invariants(expect_idle=True)


def test_prefix_caching_disabled_finds_nothing():
    kv = KVCacheManager(6, BLOCK_SIZE, enable_prefix_caching=False)
    admit(kv, FakeRequest("a", list(range(9))))
    kv.free(FakeRequest("a"))
    assert admit(kv, FakeRequest("b", list(range(9)))) == []
    assert kv.pool.num_cached_blocks == 0


def test_can_fit_is_against_the_whole_pool():
    kv = KVCacheManager(10, 16)
    assert kv.can_fit(160) and not kv.can_fit(161)


def test_invariant_check_reports_blocks_left_mapped_to_a_request():
    kv = KVCacheManager(4, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(5))))
    kv.check_invariants()
    with pytest.raises(RuntimeError):
        kv.check_invariants(expect_idle=True)


# ---- sliding-window groups (kv_cache/layout.py) --------------------------------------------
# Layer 0 slides over 8 tokens, layer 1 attends fully: group 0 is the full one, group 1 the
# sliding one, one layer each, both drawing block ids from the one pool.
WINDOW = 8


def sliding_manager(num_blocks: int = 20) -> KVCacheManager:
    return KVCacheManager(num_blocks, BLOCK_SIZE, layout=KVCacheLayout.for_windows((WINDOW, None)))


def prefill_in_chunks(kv: KVCacheManager, request: FakeRequest, chunk: int) -> None:
    while request.num_computed_tokens < len(request.all_token_ids):
        num_new = min(chunk, len(request.all_token_ids) - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new) == []
        request.num_computed_tokens += num_new


def test_layout_groups_gemma3_layers_in_threes():
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    layout = KVCacheLayout.for_windows(windows)
    assert [g.window for g in layout.groups] == [None] + [512] * 5
    assert layout.groups[0].layers == (5, 11, 17)
    assert layout.groups[1].layers == (0, 1, 2) and layout.groups[2].layers == (3, 4, 6)
    assert layout.num_tensor_pairs == 3
    assert layout.layer_to_group[6] == 2 and layout.layer_to_tensor[6] == 2


def test_layers_reading_earlier_kv_store_none_and_map_to_their_source():
    # Gemma 4 E2B's pattern: 35 layers, every fifth full, the last 20 reading the K/V of the last
    # earlier layer of their kind (13 sliding, 14 full). Only layers 0..14 store K/V: 3 full and
    # 12 sliding make 5 groups of 3 (3 tensor pairs), not the 35 layers' 7 groups of 5.
    windows = tuple(None if (i + 1) % 5 == 0 else 512 for i in range(35))
    sources = tuple(i if i < 15 else (14 if windows[i] is None else 13) for i in range(35))
    layout = KVCacheLayout.for_windows(windows, sources)
    assert [g.window for g in layout.groups] == [None] + [512] * 4
    assert layout.groups[0].layers == (4, 9, 14)
    assert sorted(layer for g in layout.groups for layer in g.layers) == list(range(15))
    assert layout.num_tensor_pairs == 3
    for layer in range(15, 35):
        source = sources[layer]
        assert (layout.layer_to_group[layer], layout.layer_to_tensor[layer]) == (
            layout.layer_to_group[source], layout.layer_to_tensor[source])


@pytest.mark.parametrize("sources", [(0, 2, 2), (0, 0, 1), (0, 1, 0)])
def test_a_layer_reads_only_an_earlier_storing_layer_of_its_window(sources):
    # (0, 2, 2): a later layer; (0, 0, 1): a layer that itself reads; (0, 1, 0): another window.
    with pytest.raises(ValueError, match="reads the K/V of layer"):
        KVCacheLayout.for_windows((8, None, None), sources)


def test_sliding_blocks_outside_the_window_go_back_to_the_free_pool():
    kv = sliding_manager()
    a = FakeRequest("a", list(range(20)))
    prefill_in_chunks(kv, a, 4)
    # Each chunk takes a full-group block, then a sliding one. Before the chunk at 12 the query
    # reads back to position 5 (block index 1), so block index 0 (id 1) is freed; at 16, index 1.
    assert kv.block_tables("a") == [[0, 2, 4, 6, 8], [NULL_BLOCK, NULL_BLOCK, 5, 7, 9]]
    assert list(kv.pool.free_queue)[-2:] == [1, 3]
    assert kv.pool.num_used_blocks == 8
    kv.check_invariants()
    kv.free(a)
    kv.check_invariants(expect_idle=True)


def test_a_cached_prefix_is_reused_where_its_window_blocks_are_still_there():
    kv = sliding_manager()
    a = FakeRequest("a", list(range(20)))
    prefill_in_chunks(kv, a, 4)
    # Block 1 (a's first sliding block, freed and still cached) is taken by someone else.
    taken = kv.pool.get_new_blocks(11)
    assert 1 in taken and 3 not in taken
    # A repeat of all 20 tokens needs only the sliding blocks of positions 13..19: a full hit.
    repeat = FakeRequest("b", list(range(20)) + [99])
    assert kv.get_computed_blocks(repeat) == ([[0, 2, 4, 6, 8], [NULL_BLOCK] * 3 + [7, 9]], 20)
    # A repeat of the first 8 needs sliding block index 0 (gone): the full group alone cannot serve it.
    short = FakeRequest("c", list(range(8)) + [99])
    assert kv.get_computed_blocks(short) == ([[], []], 0)
    kv.pool.free_blocks(taken)
    kv.free(a)
    kv.check_invariants(expect_idle=True)


def test_admitted_prefix_hit_with_freed_window_blocks_then_decodes():
    kv = sliding_manager()
    a = FakeRequest("a", list(range(20)))
    prefill_in_chunks(kv, a, 4)
    kv.free(a)
    b = FakeRequest("b", list(range(20)) + [99])
    hit, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 20
    assert kv.allocate_slots(b, 1, hit) == []
    b.num_computed_tokens = 21
    assert kv.block_tables("b") == [[0, 2, 4, 6, 8, 10], [NULL_BLOCK] * 3 + [7, 9, 11]]
    kv.check_invariants()
    kv.free(b)
    kv.check_invariants(expect_idle=True)


def test_an_agent_turn_parting_at_the_answer_hits_sliding_blocks_freed_while_it_was_generated():
    """An agent's next request re-sends the prompt and replaces the answer (a scripted turn, or
    reasoning the template drops): the prompt's last window was freed while the answer was
    generated, and must still be cached to serve it."""
    kv = sliding_manager()
    a = FakeRequest("a", list(range(12)))
    prefill_in_chunks(kv, a, 4)
    assert kv.block_tables("a") == [[0, 2, 4], [1, 3, 5]]
    for token in range(100, 107):  # decode 7 tokens (an 8th is sampled and never computed)
        a.all_token_ids.append(token)
        assert kv.allocate_slots(a, 1) == []
        a.num_computed_tokens += 1
    # At 19 computed tokens the window reads back to position 12: sliding blocks 1 and 3 are free.
    assert kv.block_tables("a") == [[0, 2, 4, 6, 8], [NULL_BLOCK, NULL_BLOCK, 5, 7, 9]]
    kv.free(a)
    # The next query at 12 reads positions 5..11: sliding block index 1 (id 3), freed but cached.
    b = FakeRequest("b", list(range(12)) + [200, 201, 202, 203, 204])
    assert kv.get_computed_blocks(b) == ([[0, 2, 4], [NULL_BLOCK, 3, 5]], 12)
    kv.check_invariants(expect_idle=True)


def test_a_long_request_fits_in_far_fewer_blocks_with_sliding_groups():
    kv = sliding_manager(num_blocks=14)
    # 40 tokens: 10 full-group blocks, and at most (window + chunk + a block) / 4 = 4 sliding ones.
    assert kv.can_fit(40, max_chunk_tokens=4) and not kv.can_fit(41, max_chunk_tokens=4)
    # The same memory with both layers full: 7 blocks of two layers each, 28 tokens at most.
    assert KVCacheManager(7, BLOCK_SIZE, layout=KVCacheLayout.for_windows((None, None))).max_request_tokens() == 28
    a = FakeRequest("a", list(range(40)))
    prefill_in_chunks(kv, a, 4)
    assert kv.pool.num_used_blocks == 10 + 3
    kv.free(a)
    kv.check_invariants(expect_idle=True)


def test_a_finished_requests_partly_filled_last_block_is_lent_to_the_next_turn():
    kv = KVCacheManager(16, BLOCK_SIZE)
    a = FakeRequest("a", list(range(11)))
    admit(kv, a)
    a.all_token_ids.append(11)  # sampled, never computed: not part of what a's tail holds
    kv.free(a)
    # Two full blocks, and block 2's tail, which disk (cached_block_keys) never gets.
    assert len(kv.pool.cached_blocks()) == 3 and kv.cached_block_keys() == kv.pool.cached_blocks()[:2]
    # The next turn re-sends a's 11 computed tokens and more: all 11 hit, 3 copied from the tail.
    b = FakeRequest("b", list(range(11)) + [40, 41])
    assert admit(kv, b) == [0, 1, 2] and b.copies == [(2, kv.block_ids("b")[2])]
    assert kv.prefix_cache_hits == 11
    # The sampled token a never computed is not lent: 11 of these 12 match, the 12th is computed.
    c = FakeRequest("c", list(range(12)) + [7])
    admit(kv, c)
    assert kv.prefix_cache_hits == 11 + 11
    kv.check_invariants()


def test_a_tail_held_by_another_request_is_not_cached():
    kv = KVCacheManager(16, BLOCK_SIZE)
    a = FakeRequest("a", list(range(6)))
    admit(kv, a)
    child = FakeRequest("child", list(range(6)))
    kv.fork(a, child, 6)
    kv.free(a)  # block 1 is still child's, which may write into it: not a's tail to lend
    assert [key for _, key in kv.pool.cached_blocks()] == [kv.pool.block_hashes[0]]
    kv.free(child)
    kv.check_invariants()


def test_a_block_this_pass_writes_is_shared_whole_but_never_copied_from():
    # Copies run before the step, the step writes the pass's new blocks: a partial hit on a block
    # registered in the same pass would copy bytes not written yet.
    kv = KVCacheManager(16, BLOCK_SIZE)
    a = FakeRequest("a", list(range(12)))
    tables, num_cached = kv.get_computed_blocks(a)
    kv.allocate_slots(a, 12, tables, num_hit_tokens=num_cached)
    a.num_computed_tokens = 12
    b = FakeRequest("b", list(range(10)) + [50, 51])  # same pass: blocks 0 and 1 whole, no part of 2
    assert kv.get_computed_blocks(b) == ([[0, 1]], 8)
    kv.take_transfers()
    c = FakeRequest("c", list(range(10)) + [50, 51])  # the next pass: block 2 lends two tokens
    assert kv.get_computed_blocks(c) == ([[0, 1, 2]], 10)


def test_a_request_left_mid_prompt_lends_its_tail_below_its_own_last_full_block():
    kv = KVCacheManager(16, BLOCK_SIZE)
    a = FakeRequest("a", list(range(12)))
    tables, num_cached = kv.get_computed_blocks(a)  # hashes the prompt's blocks, past what a computes
    kv.allocate_slots(a, 6, tables, num_hit_tokens=num_cached)  # a first chunk of 6 tokens
    a.num_computed_tokens = 6
    kv.take_transfers()
    kv.free(a)  # the client left: block 1 holds tokens 4 and 5, below block 0
    b = FakeRequest("b", list(range(6)) + [90, 91])
    tables, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 6 and tables == [[0, 1]]


def test_a_lent_block_is_held_until_the_pass_ends():
    kv = KVCacheManager(8, BLOCK_SIZE)
    admit(kv, FakeRequest("a", list(range(12))))
    kv.free(FakeRequest("a"))
    b = FakeRequest("b", list(range(9)) + [70, 71, 72])
    tables, num_cached = kv.get_computed_blocks(b)
    (source, destination), = kv.allocate_slots(b, 3, tables, num_hit_tokens=num_cached)
    assert kv.pool.ref_counts[source] == 1 and source not in kv.pool.free_queue  # no new block nor load takes it
    kv.take_transfers()  # the runner copies it before the step; then it is let go, still cached
    assert kv.pool.ref_counts[source] == 0 and kv.pool.block_hashes[source] is not None
    kv.check_invariants()
