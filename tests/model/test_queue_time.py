"""The queue-time metric under load: with one sequence at a time, requests sent together wait for
each other, and `tokios:request_queue_time_seconds` records each one's wait (arrival to first
being scheduled) through the server's own stream bookkeeping (server/streams.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from tokios.sampling_params import SamplingParams
from tokios.server.admission import Admission
from tokios.server.metrics import ServerMetrics
from tokios.server.streams import EngineStream

NUM_REQUESTS = 3
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def engine():
    from tokios.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
    from tokios.engine import AsyncEngine

    return AsyncEngine(EngineConfig(load=LoadConfig(dtype="float32"),
                                    cache=CacheConfig(kv_cache_memory_bytes=16 * 1024**2),
                                    scheduler=SchedulerConfig(max_num_seqs=1)))


def test_queue_time_records_each_requests_wait(engine):
    serving = SimpleNamespace(engine=engine, admission=Admission(max_num_running=4, max_queued_requests=4),
                              metrics=ServerMetrics(lambda: []), model_name="m",
                              settings=SimpleNamespace(log_requests=False))
    serving.metrics.add_model("m")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    streams = [EngineStream(serving, f"q{i}", engine.tokenizer.encode(f"Request {i}: tell me a story"), params, {})
               for i in range(NUM_REQUESTS)]

    async def drain(stream: EngineStream):
        async for _ in stream:
            pass
        return stream.last_output

    async def scenario():
        return await asyncio.gather(*(drain(stream) for stream in streams))

    outputs = asyncio.run(scenario())
    metrics = [output.metrics for output in outputs]
    assert all(len(output.outputs[0].token_ids) == MAX_TOKENS for output in outputs)
    assert all(m.first_scheduled_time is not None and m.first_scheduled_time >= m.arrival_time for m in metrics)
    # One at a time: each request after the first was scheduled only once the one before it ended.
    by_start = sorted(metrics, key=lambda m: m.first_scheduled_time)
    for earlier, later in zip(by_start, by_start[1:]):
        assert later.first_scheduled_time > earlier.finished_time
    waits = [m.first_scheduled_time - m.arrival_time for m in metrics]

    registry = serving.metrics.registry
    labels = {"model_name": "m"}
    assert registry.get_sample_value("tokios:request_queue_time_seconds_count", labels) == NUM_REQUESTS
    assert registry.get_sample_value("tokios:request_queue_time_seconds_sum", labels) == pytest.approx(sum(waits))
    assert sum(waits) > 0
