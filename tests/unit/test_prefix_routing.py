"""Prefix-aware routing, without processes: the block pool's cache event log, the gateway's index of
what each backend holds, the prompt hashing that must equal the KV manager's, and the router's
decisions (prefix, threshold, imbalance, session)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from test_gateway_parts import FakeBackend

from tokios.errors import InvalidRequestError
from tokios.gateway.connector import cache_event_frames
from tokios.gateway.prefix_index import HashScheme, PrefixIndex, PrefixQuery, block_hashes
from tokios.gateway.protocol import FrameKind, decode
from tokios.gateway.router import BackendRouter, PrefixPolicy
from tokios.kv_cache.block_pool import BlockPool
from tokios.kv_cache.events import CacheEventLog
from tokios.kv_cache.manager import KVCacheManager


def hexes(keys):
    return [f"{key:032x}" for key in keys]


def test_the_log_gives_the_net_change_since_a_reader_and_a_snapshot_when_it_cannot():
    log = CacheEventLog(max_events=4)
    first = log.read(-1)
    assert first.is_reset and first.stored_hashes == [] and first.next_seq == 0
    log.record_stored(11)
    log.record_stored(12)
    log.record_removed(11)
    log.record_stored((1, 13))  # another group's key: not logged
    events = log.read(0, log.log_id)
    assert (events.is_reset, events.stored_hashes, events.removed_hashes, events.next_seq) == (False, [12], [11], 3)
    assert log.read(3, log.log_id).stored_hashes == []
    # Stored again after its removal: the last event counts.
    log.record_stored(11)
    assert log.read(2, log.log_id).stored_hashes == [11]
    # A reader whose events fell out of the bounded log, or who read another log, gets a snapshot.
    for key in (20, 21, 22):
        log.record_stored(key)
    assert log.read(0, log.log_id).is_reset
    snapshot = log.read(5, "another-log")
    assert snapshot.is_reset and sorted(snapshot.stored_hashes) == [11, 12, 20, 21, 22]


def test_the_pool_logs_what_enters_and_leaves_its_hash_map():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 100)
    pool.cache_block(blocks[1], 100)  # a duplicate stays private: no event
    pool.free_blocks(blocks)
    pool.get_new_blocks(2)  # reuses both; the cached one's hash is evicted
    events = pool.cache_events.read(0, pool.cache_events.log_id)
    assert events.removed_hashes == [100] and events.stored_hashes == []
    assert pool.cache_events.read(-1).stored_hashes == []


@dataclass
class _Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0


def test_the_gateway_hashes_a_prompt_as_the_kv_manager_does():
    manager = KVCacheManager(num_blocks=64, block_size=16, cache_salt="model.gguf|Q4_1|template")
    token_ids = list(range(1000, 1000 + 16 * 5 + 7))
    expected = manager._block_hashes(_Request("r", token_ids), len(token_ids))
    assert block_hashes(token_ids, HashScheme(16, manager.root_hash)) == expected
    assert len(expected) == 5  # full blocks only


def test_the_index_applies_resets_and_changes_and_forgets_a_backend():
    scheme = HashScheme(4, 7)
    prompt = list(range(4 * 6))
    hashes = block_hashes(prompt, scheme)
    index = PrefixIndex()
    index.apply("a", {"model": "m", "reset": True, "block_size": 4, "root_hash": "7", "stored": hexes(hashes[:4])})
    index.apply("b", {"model": "m", "reset": True, "block_size": 4, "root_hash": "7", "stored": hexes(hashes[:1])})
    query = PrefixQuery(index, "m", prompt)
    assert [query.num_matched_tokens(backend_id) for backend_id in ("a", "b", "c")] == [16, 4, 0]
    # A dropped middle block ends the reusable prefix there (the chain breaks).
    index.apply("a", {"model": "m", "removed": hexes(hashes[1:2])})
    assert PrefixQuery(index, "m", prompt).num_matched_tokens("a") == 4
    # A reset replaces the set; a model not loaded there (no scheme) holds nothing.
    index.apply("a", {"model": "m", "reset": True, "block_size": 4, "root_hash": "7", "stored": hexes(hashes)})
    assert PrefixQuery(index, "m", prompt).num_matched_tokens("a") == 24
    index.apply("b", {"model": "m", "reset": True, "block_size": 0, "root_hash": "", "stored": []})
    assert PrefixQuery(index, "m", prompt).num_matched_tokens("b") == 0
    assert index.num_blocks("a") == 6 and index.backend_ids() == ["a", "b"]
    index.drop("a")
    assert index.backend_ids() == ["b"] and PrefixQuery(index, "m", prompt).num_matched_tokens("a") == 0
    with pytest.raises(InvalidRequestError, match="stored"):
        index.apply("a", {"model": "m", "stored": ["not hex"]})
    with pytest.raises(InvalidRequestError, match="model"):
        index.apply("a", {"stored": []})


def test_a_large_snapshot_is_cut_into_frames_that_rebuild_it():
    keys = [f"{key:032x}" for key in range(2000)]
    frames = cache_event_frames("m", {"reset": True, "block_size": 16, "root_hash": "ab", "stored": keys,
                                      "removed": []})
    assert len(frames) > 1
    payloads = [frame.json() for data in frames for frame in decode(data)]
    assert all(frame.kind is FrameKind.CACHE_EVENTS for data in frames for frame in decode(data))
    assert [payload["reset"] for payload in payloads] == [True] + [False] * (len(payloads) - 1)
    index = PrefixIndex()
    for payload in payloads:
        index.apply("a", payload)
    assert index.num_blocks("a") == 2000


class FakePrefix:
    def __init__(self, num_prompt_tokens: int, backend_id_to_num_matched: dict[str, int]):
        self.num_prompt_tokens = num_prompt_tokens
        self.backend_id_to_num_matched = backend_id_to_num_matched

    def num_matched_tokens(self, backend_id: str) -> int:
        return self.backend_id_to_num_matched.get(backend_id, 0)


def make_router(policy: PrefixPolicy | None = PrefixPolicy(), loads=(0, 0, 0)) -> BackendRouter:
    router = BackendRouter(prefix_policy=policy)
    for name, load in zip("abc", loads):
        router.add(FakeBackend(name, num_in_flight=load))
    return router


def test_the_router_prefers_the_longest_cached_prefix_above_the_threshold():
    router = make_router(loads=(0, 3, 1))
    assert router.pick("m", prefix=FakePrefix(100, {"b": 60, "c": 40})).backend_id == "b"
    # Below 30% of the prompt: the least busy, as without a prefix.
    assert router.pick("m", prefix=FakePrefix(100, {"b": 29})).backend_id == "a"
    # Equal matches go to the less busy of them.
    assert router.pick("m", prefix=FakePrefix(100, {"b": 50, "c": 50})).backend_id == "c"
    # No policy: load alone.
    assert make_router(None, loads=(0, 3, 1)).pick("m", prefix=FakePrefix(100, {"b": 100})).backend_id == "a"
    assert router.decision_to_count == {"prefix": 2, "least_busy": 1}


def test_uneven_load_routes_by_load_and_a_session_wins_over_the_prefix():
    policy = PrefixPolicy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    busy = make_router(policy, loads=(10, 1, 2))
    assert busy.pick("m", prefix=FakePrefix(100, {"a": 100})).backend_id == "b"
    assert busy.decision_to_count == {"imbalance": 1, "least_busy": 1}
    # 10 against 7: more than 1.5x is not met, so the prefix still decides.
    assert make_router(policy, loads=(10, 7, 7)).pick("m", prefix=FakePrefix(100, {"a": 100})).backend_id == "a"
    router = make_router(policy)
    router.pin("s", "c")
    assert router.pick("m", session_id="s", prefix=FakePrefix(100, {"a": 100})).backend_id == "c"


def test_bad_policy_values_name_the_field():
    for kwargs, field in (({"cache_threshold": 1.5}, "cache_threshold"),
                          ({"balance_abs_threshold": -1}, "balance_abs_threshold"),
                          ({"balance_rel_threshold": 0.5}, "balance_rel_threshold")):
        with pytest.raises(InvalidRequestError) as error:
            PrefixPolicy(**kwargs)
        assert error.value.param == field


def test_the_owner_of_a_stored_response_answers_even_cooling_and_keeps_its_pin():
    clock_time = [0.0]
    router = BackendRouter(prefix_policy=PrefixPolicy(), max_consecutive_failures=1, clock=lambda: clock_time[0])
    a, b = FakeBackend("a", num_in_flight=9), FakeBackend("b")
    router.add(a)
    router.add(b)
    router.pin("response:r1", "a")
    router.record_failure("a")  # cooling now
    assert router.is_cooling("a")
    assert router.pick("m", owner_backend_id="a").backend_id == "a"
    assert router.pick("m", session_id="s", owner_backend_id="a", prefix=FakePrefix(10, {"b": 10})).backend_id == "a"
    assert router.pinned_backend("response:r1") is a
    # Excluded after a failed attempt, or gone: the others by the usual rules.
    assert router.pick("m", exclude=["a"], owner_backend_id="a").backend_id == "b"
    assert router.decision_to_count["owner"] == 2


class _FakeTokenizer:
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        return [ord(char) % 100 for char in text]


def test_prompt_ids_for_routing_skip_ids_the_backend_would_refuse_and_cut_long_prompts():
    from tokios.gateway import prefix_index
    from tokios.gateway.prefix_index import PromptHasher

    hasher = PromptHasher({})
    hasher._model_to_tokenizer["m"] = _FakeTokenizer()
    assert hasher.prompt_token_ids("/v1/completions", {"model": "m", "prompt": [1, 2, 3]}) == [1, 2, 3]
    for bad in ([-1] * 16, [100], [2**40], [True]):
        assert hasher.prompt_token_ids("/v1/completions", {"model": "m", "prompt": bad}) is None
    long_text = "x" * (prefix_index.MAX_HASHED_CHARS * 3)
    ids = hasher.prompt_token_ids("/v1/completions", {"model": "m", "prompt": long_text})
    assert len(ids) == prefix_index.MAX_HASHED_CHARS - 64
    assert hasher.prompt_token_ids("/v1/completions", {"model": "other", "prompt": "x"}) is None
