"""100 requests at once through AsyncEngine with every 10th aborted midway.

Half of the aborted ones are dropped by their consumer (the async iterator is closed after a
few tokens, as when an HTTP client disconnects); the other half are cancelled with
engine.abort(request_id) and must end with finish_reason "abort". Every other request must
return exactly its max_tokens (ignore_eos). Afterwards nothing is running or waiting, every
KV block is free or cached with reference count 0, and the engine still serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tokios.sampling_params import SamplingParams

NUM_REQUESTS = 100
MAX_TOKENS = 8
ABORTED_MAX_TOKENS = 64  # far more than the tokens seen before the abort: it is cut midway
TOKENS_BEFORE_ABORT = 2


@pytest.fixture(scope="module")
def engine():
    from tokios.config import CacheConfig, EngineConfig, LoadConfig
    from tokios.engine import AsyncEngine

    return AsyncEngine(EngineConfig(load=LoadConfig(dtype="float32"),
                                    cache=CacheConfig(kv_cache_memory_bytes=64 * 1024**2)))


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def dropped_by_consumer(engine, index: int):
    stream = engine.generate(f"Story {index}: once upon a time", params(ABORTED_MAX_TOKENS), request_id=f"r{index}")
    async with contextlib.aclosing(stream):
        async for output in stream:
            if len(output.outputs[0].token_ids) >= TOKENS_BEFORE_ABORT:
                return len(output.outputs[0].token_ids)
    raise AssertionError(f"r{index} ended before the consumer left")


async def aborted_by_id(engine, index: int):
    request_id = f"r{index}"
    final = None
    abort_sent = False
    async for output in engine.generate(f"Story {index}: once upon a time", params(ABORTED_MAX_TOKENS),
                                        request_id=request_id):
        if not abort_sent and len(output.outputs[0].token_ids) >= TOKENS_BEFORE_ABORT:
            engine.abort(request_id)
            abort_sent = True
        final = output
    assert abort_sent, f"{request_id} ended before it could be aborted"
    return final


async def runs_to_the_end(engine, index: int):
    final = None
    async for output in engine.generate(f"Story {index}: once upon a time", params(MAX_TOKENS),
                                        request_id=f"r{index}"):
        final = output
    return final


async def wait_until_idle(engine, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        assert time.monotonic() < deadline, f"engine still busy: {stats}"
        await asyncio.sleep(0.05)


def test_every_tenth_aborted_the_rest_exact_and_nothing_leaks(engine):
    async def scenario():
        tasks = {}
        for index in range(NUM_REQUESTS):
            if index % 20 == 0:
                tasks[index] = dropped_by_consumer(engine, index)
            elif index % 10 == 0:
                tasks[index] = aborted_by_id(engine, index)
            else:
                tasks[index] = runs_to_the_end(engine, index)
        results = dict(zip(tasks, await asyncio.gather(*tasks.values())))
        await wait_until_idle(engine)
        engine.check_invariants()
        after_stats = engine.stats()
        # The engine still serves after the aborts.
        followup = await runs_to_the_end(engine, NUM_REQUESTS)
        await wait_until_idle(engine)
        engine.check_invariants()
        await engine.shutdown()
        return results, after_stats, followup

    results, stats, followup = asyncio.run(scenario())

    for index, result in results.items():
        if index % 20 == 0:
            assert TOKENS_BEFORE_ABORT <= result < ABORTED_MAX_TOKENS
        elif index % 10 == 0:
            completion = result.outputs[0]
            assert result.finished and completion.finish_reason == "abort", index
            assert TOKENS_BEFORE_ABORT <= len(completion.token_ids) < ABORTED_MAX_TOKENS
        else:
            completion = result.outputs[0]
            assert result.finished and completion.finish_reason == "length", index
            assert len(completion.token_ids) == MAX_TOKENS, index
    assert stats.num_blocks_used == 0 and stats.num_running == stats.num_waiting == 0
    assert engine.num_unfinished_requests == 0
    assert len(followup.outputs[0].token_ids) == MAX_TOKENS
