"""The prefix cache's disk tier (kv_cache/disk_tier.py) on real files, and the KV manager's
spills and loads with exact block ids (kv_cache/manager.py take_transfers).

Payloads here are made-up bytes: what a block's bytes mean is the runner's business
(tests/model/test_kv_disk_tier.py runs the real model across a restart)."""

from __future__ import annotations

import logging

import pytest

from tokios.kv_cache.disk_tier import SUFFIX, DiskPrefixCache, fingerprint, key_bytes
from tokios.kv_cache.manager import KVCacheManager, chain_hash, salt_hash
from tests.unit.test_kv_manager import BLOCK_SIZE, FakeRequest
from tests.unit.test_kv_manager import admit as admit_and_end_pass


def admit(kv: KVCacheManager, request: FakeRequest) -> list[int]:
    """Admitted; the pass ends when the runner below takes the transfers."""
    return admit_and_end_pass(kv, request, end_pass=False)

PAYLOAD = 64
IDENTITY = fingerprint("model-a", "bfloat16", 16)


def payload_of(key) -> bytes:
    seed = hash(key) & 0xFF
    return bytes((seed + i) % 256 for i in range(PAYLOAD))


def block_keys(token_ids: list[int], salt: str = "") -> list[int]:
    """The cache keys of the full blocks of token_ids (group 0: the chained hash itself)."""
    keys, parent = [], salt_hash(salt)
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        parent = chain_hash(parent, token_ids[start:start + BLOCK_SIZE])
        keys.append(parent)
    return keys


def open_tier(path, max_bytes: int = 1 << 20, identity: bytes = IDENTITY) -> DiskPrefixCache:
    return DiskPrefixCache(path, max_bytes, identity)


def test_a_block_written_is_read_back_after_a_restart(tmp_path):
    tier = open_tier(tmp_path)
    tier.write_async(12345, payload_of(12345))
    tier.write_async((2, 777), payload_of((2, 777)))
    tier.flush()
    again = open_tier(tmp_path)
    assert 12345 in again and (2, 777) in again and 999 not in again
    assert again.read(12345, PAYLOAD) == payload_of(12345)
    assert again.read((2, 777), PAYLOAD) == payload_of((2, 777))
    assert again.read(999, PAYLOAD) is None


@pytest.mark.parametrize("damage", ["flip a payload byte", "truncate", "empty", "wrong size expected"])
def test_a_damaged_file_is_detected_removed_and_never_served(tmp_path, damage, caplog):
    tier = open_tier(tmp_path)
    tier.write_async(42, payload_of(42))
    tier.flush()
    (path,) = tier.directory.glob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    expected_size = PAYLOAD
    if damage == "flip a payload byte":
        data[-1] ^= 0x01
    elif damage == "truncate":
        data = data[:-10]
    elif damage == "empty":
        data = bytearray()
    else:
        expected_size = PAYLOAD * 2  # a block of another shape
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="tokios.kv_cache"):
        assert open_tier(tmp_path).read(42, expected_size) is None
    assert "recomputed" in caplog.text
    assert not path.exists()


def test_another_models_files_are_never_read(tmp_path):
    tier = open_tier(tmp_path)
    tier.write_async(42, payload_of(42))
    tier.flush()
    other = open_tier(tmp_path, identity=fingerprint("model-b", "bfloat16", 16))
    assert 42 not in other and other.read(42, PAYLOAD) is None
    # A file copied into the other model's directory is foreign by its header.
    (source,) = tier.directory.glob(f"*{SUFFIX}")
    (other.directory / source.name).write_bytes(source.read_bytes())
    reopened = open_tier(tmp_path, identity=fingerprint("model-b", "bfloat16", 16))
    assert reopened.read(42, PAYLOAD) is None and reopened.num_rejected == 1


def test_the_directory_never_grows_past_its_limit_and_drops_the_least_recently_used(tmp_path):
    probe = open_tier(tmp_path / "probe")
    probe.write_async(0, payload_of(0))
    probe.flush()
    file_bytes = probe.total_bytes
    tier = open_tier(tmp_path / "tier", max_bytes=3 * file_bytes)
    for key in (1, 2, 3):
        tier.write_async(key, payload_of(key))
    tier.flush()
    assert tier.read(1, PAYLOAD) is not None  # 1 is now the most recently used
    tier.write_async(4, payload_of(4))
    tier.flush()
    assert [k for k in (1, 2, 3, 4) if k in tier] == [1, 3, 4]
    assert sum(p.stat().st_size for p in tier.directory.iterdir()) <= 3 * file_bytes
    # The order survives a restart (modification times), and a smaller limit trims at start.
    smaller = open_tier(tmp_path / "tier", max_bytes=2 * file_bytes)
    assert [k for k in (1, 2, 3, 4) if k in smaller] == [1, 4] or [k for k in (1, 3, 4) if k in smaller] == [3, 4]
    assert smaller.total_bytes <= 2 * file_bytes


def test_an_unwritable_directory_turns_the_tier_off_with_one_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="tokios.kv_cache"):
        tier = open_tier(blocker / "cache")
        for key in range(5):
            tier.write_async(key, payload_of(key))
        tier.flush()
    assert not tier.is_writable and tier.num_files == 0 and tier.read(1, PAYLOAD) is None
    assert len([r for r in caplog.records if "memory cache only" in r.message]) == 1


def test_a_full_disk_turns_writing_off_once_and_keeps_what_is_there(tmp_path, caplog, monkeypatch):
    tier = open_tier(tmp_path)
    tier.write_async(1, payload_of(1))
    tier.flush()
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".partial"):
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    with caplog.at_level(logging.WARNING, logger="tokios.kv_cache"):
        for key in range(2, 6):
            tier.write_async(key, payload_of(key))
        tier.flush()
    monkeypatch.undo()
    assert not tier.is_writable
    assert len([r for r in caplog.records if "No space left" in r.message]) == 1
    assert tier.read(1, PAYLOAD) == payload_of(1)
    assert not list(tier.directory.glob("*.partial"))


class RecordingRunner:
    """What the runner does with take_transfers: spills read the block's bytes before loads write."""

    def __init__(self, tier: DiskPrefixCache):
        self.tier = tier
        self.contents: dict[int, bytes] = {}  # block id -> the bytes it holds

    def compute(self, kv: KVCacheManager, request: FakeRequest) -> None:
        for block_id, key in kv.cached_block_keys():
            if block_id in kv.block_ids(request.request_id):
                self.contents[block_id] = payload_of(key)

    def apply(self, kv: KVCacheManager):
        spills, loads = kv.take_transfers()
        for block_id, key in spills:
            self.tier.write_async(key, self.contents[block_id])
        for block_id, key, payload in loads:
            self.contents[block_id] = payload
        self.tier.flush()
        return spills, loads


def test_evicted_blocks_go_to_disk_and_come_back_into_exact_blocks(tmp_path):
    tier = open_tier(tmp_path)
    kv = KVCacheManager(4, BLOCK_SIZE, disk=tier, block_payload_bytes=PAYLOAD)
    runner = RecordingRunner(tier)
    a = FakeRequest("a", list(range(13)))  # 3 full blocks + 1 token
    admit(kv, a)
    runner.compute(kv, a)
    assert runner.apply(kv) == ([], [])
    kv.free(a)  # blocks 3, 2, 1, 0 join the free queue tail first: 3 (partial) is evicted first
    b = FakeRequest("b", list(range(100, 113)))
    admit(kv, b)  # takes all 4 blocks: a's three cached ones are evicted
    spills, loads = runner.apply(kv)
    a_keys = block_keys(a.all_token_ids)
    assert spills == [(2, a_keys[2]), (1, a_keys[1]), (0, a_keys[0])] and loads == []
    runner.compute(kv, b)
    kv.free(b)
    # a again: its 3 blocks are on disk; b's cached blocks are evicted (spilled) to hold them.
    a_again = FakeRequest("a2", list(range(13)))
    hit, num_cached = kv.get_computed_blocks(a_again)
    assert num_cached == 12 and kv.disk_hits == 12
    spills, loads = runner.apply(kv)
    # b held [3, 2, 1, 0] (0 partial) and freed them tail first: the loads take 0, 1, 2, and
    # b's cached blocks among them (1 and 2: its third and second) leave for disk first.
    assert [block for block, _, _ in loads] == hit[0] == [0, 1, 2]
    assert [payload for _, _, payload in loads] == [payload_of(key) for key in a_keys]
    b_keys = block_keys(b.all_token_ids)
    assert spills == [(1, b_keys[2]), (2, b_keys[1])]
    assert tier.read(b_keys[2], PAYLOAD) == payload_of(b_keys[2])
    assert kv.allocate_slots(a_again, 1, hit) == []
    kv.check_invariants()


def test_a_bad_block_file_ends_the_hit_there(tmp_path):
    tier = open_tier(tmp_path)
    kv = KVCacheManager(8, BLOCK_SIZE, disk=tier, block_payload_bytes=PAYLOAD)
    keys = block_keys(list(range(13)))
    for key in keys:
        tier.write_async(key, payload_of(key))
    tier.flush()
    second = tier.directory / f"{key_bytes(keys[1]).hex()}{SUFFIX}"
    second.write_bytes(second.read_bytes()[:-1])  # the second block is truncated
    hit, num_cached = kv.get_computed_blocks(FakeRequest("x", list(range(13))))
    assert num_cached == BLOCK_SIZE and len(hit[0]) == 1
    _, loads = kv.take_transfers()
    assert len(loads) == 1
