"""A request's bookkeeping in the server (server/streams.py): every request that arrived is logged
and counted once, also one whose client left before it reached the engine."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

from tokios.server.admission import Admission
from tokios.server.metrics import ServerMetrics
from tokios.server.streams import EngineStream, Job


class EngineNeverReached:
    def generate(self, *args, **kwargs):
        raise AssertionError("the request was cancelled before it could reach the engine")

    def abort(self, request_id: str) -> None:
        raise AssertionError("nothing to abort: the request never reached the engine")


def serving_stand_in() -> SimpleNamespace:
    return SimpleNamespace(engine=EngineNeverReached(), admission=Admission(max_num_running=4, max_queued_requests=4),
                           metrics=ServerMetrics(lambda: []), model_name="m",
                           settings=SimpleNamespace(log_requests=True))


def aborted_count(serving) -> float:
    return serving.metrics.registry.get_sample_value(
        "tokios:request_success_total", {"model_name": "m", "finished_reason": "abort"}) or 0.0


def test_a_request_cancelled_before_it_starts_is_logged_and_counted_as_aborted(caplog):
    async def scenario():
        serving = serving_stand_in()
        job = Job(serving.admission.admit(), [EngineStream(serving, "chatcmpl-1-0", [1, 2, 3], SimpleNamespace(n=1),
                                                           {"max_tokens": 8})])
        starting = asyncio.ensure_future(job.first_outputs())
        starting.cancel()  # the client's disconnect, seen before the job's first step ran
        await asyncio.gather(starting, return_exceptions=True)
        await job.close()
        await job.close()  # twice is safe and records nothing more
        return serving

    with caplog.at_level(logging.INFO, logger="tokios.requests"):
        serving = asyncio.run(scenario())
    lines = [record.getMessage() for record in caplog.records if record.name == "tokios.requests"]
    assert len(lines) == 1 and "request_id=chatcmpl-1-0" in lines[0] and "finish_reason=abort" in lines[0], lines
    assert aborted_count(serving) == 1
    assert serving.admission.num_in_flight == 0
