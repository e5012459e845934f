"""The prefix cache's disk tier on the real model: the same greedy tokens with the tier on and off,
across a restart (a new engine over the same directory), after blocks were evicted to disk
under memory pressure, and with a corrupted block file (skipped, the prompt recomputed)."""

from __future__ import annotations

import pytest

from tokios.engine import LLM
from tokios.kv_cache.disk_tier import SUFFIX, key_bytes
from tokios.kv_cache.manager import chain_hash
from tokios.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# About 300 tokens: 18 full blocks of 16.
PROMPT = ("The history of the river town begins with the mill, the bridge and the market. " * 20).strip()
OTHER_PROMPTS = [f"Write about the {word} in the old quarter, its people and its streets. " * 18
                 for word in ("garden", "station", "library", "harbour")]


def tokens(llm: LLM, prompt: str) -> list[int]:
    return llm.generate(prompt, GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def reference_tokens():
    return tokens(LLM(kv_cache_memory="64MiB"), PROMPT)


def test_a_restart_loads_the_prefix_from_disk_and_generates_the_same_tokens(tmp_path, reference_tokens):
    first = LLM(kv_cache_memory="64MiB", kv_cache_disk=str(tmp_path))
    assert tokens(first, PROMPT) == reference_tokens
    assert first.stats().disk_cache_hit_tokens == 0
    first.close()  # shutdown: the memory cache goes to disk
    files = list(tmp_path.rglob(f"*{SUFFIX}"))
    assert len(files) >= 18

    restarted = LLM(kv_cache_memory="64MiB", kv_cache_disk=str(tmp_path))
    assert tokens(restarted, PROMPT) == reference_tokens
    stats = restarted.stats()
    assert stats.disk_cache_hit_tokens >= 18 * 16 and stats.disk_cache_rejected == 0
    restarted.check_invariants()

    # The prompt's fifth block damaged on disk: detected, skipped, recomputed from there on.
    key = restarted.core.kv.root_hash
    token_ids = restarted.tokenizer.encode(PROMPT)
    for index in range(5):
        key = chain_hash(key, token_ids[index * 16:(index + 1) * 16])
    path = restarted.core.disk_cache.directory / f"{key_bytes(key).hex()}{SUFFIX}"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    damaged = LLM(kv_cache_memory="64MiB", kv_cache_disk=str(tmp_path))
    assert tokens(damaged, PROMPT) == reference_tokens
    stats = damaged.stats()
    assert (stats.disk_cache_rejected, stats.disk_cache_hit_tokens) == (1, 4 * 16)
    assert not path.exists()


def test_blocks_evicted_under_memory_pressure_come_back_from_disk(tmp_path, reference_tokens):
    # 10 MiB of bfloat16 KV at 23,040 bytes a token holds 455 tokens (28 blocks): each new
    # ~300-token prompt evicts the blocks of the one before.
    llm = LLM(kv_cache_memory="10MiB", kv_cache_disk=str(tmp_path))
    assert tokens(llm, PROMPT) == reference_tokens
    for prompt in OTHER_PROMPTS:
        tokens(llm, prompt)
    llm.core.disk_cache.flush()
    before = llm.stats()
    assert before.disk_cache_writes >= 18
    assert tokens(llm, PROMPT) == reference_tokens
    assert llm.stats().disk_cache_hit_tokens - before.disk_cache_hit_tokens >= 16 * 16
    llm.check_invariants()
