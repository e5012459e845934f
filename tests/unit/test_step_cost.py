"""Fair chunked prefill: the step cost model (scheduler/step_cost.py) and the scheduler's chunks
under a step time budget, driven by a synthetic clock whose cost is known exactly.

The clock charges each step TRUE_COST (a fixed weights read, a per-row matmul cost and a
per-pair attention cost, the shape a CPU decode step has) plus a little noise; the scheduler
only sees the measured seconds, as it does in the engine.
"""

from __future__ import annotations

import random

import pytest

from tokios.scheduler.scheduler import AUTO_STEP_BUDGET, CALIBRATION_CHUNK, MIN_PREFILL_CHUNK
from tokios.scheduler.step_cost import StepCostModel
from tests.unit.test_scheduler import fake_next_token, make_request, make_scheduler

def true_seconds(output) -> float:
    """A CPU step's shape: a fixed weights read, a matmul cost per row, and attention per
    (query, key) pair, so a prompt token late in a long prompt costs more than an early one."""
    rows = output.num_scheduled_tokens
    pairs = sum(s.num_new_tokens * (s.request.num_computed_tokens + (s.num_new_tokens + 1) / 2)
                for s in output.scheduled)
    return 0.020 + 0.0015 * rows + 2e-7 * pairs


def run_clocked_step(scheduler, rng, noise: float = 0.03):
    output = scheduler.schedule()
    seconds = true_seconds(output) * (1 + rng.uniform(-noise, noise))
    scheduler.observe_step(output, seconds)
    sampled = {s.request.request_id: [fake_next_token(s.request)] for s in output.scheduled if s.samples_this_step}
    scheduler.update(output, sampled)
    return output, seconds


def test_the_model_learns_decode_steps_and_the_marginal_prefill_token():
    model = StepCostModel()
    assert not model.is_calibrated and model.max_prefill_tokens(1.0) == 0
    for _ in range(30):
        model.observe(8, 0, 0.030)
    assert model.decode_s == pytest.approx(0.030)
    assert not model.is_calibrated  # nothing yet says what a prompt token costs
    for _ in range(30):
        model.observe(8, 20, 0.030 + 20 * 0.002)
    assert model.seconds_per_prefill_token == pytest.approx(0.002)
    assert model.max_prefill_tokens(0.0301) == 15


def test_a_prompt_alone_teaches_the_per_token_cost_too():
    model = StepCostModel()
    model.observe(0, 512, 1.024)
    model.observe(4, 0, 0.01)
    assert model.is_calibrated and model.seconds_per_prefill_token == pytest.approx(0.002)


def test_noise_never_makes_a_prompt_token_free():
    model = StepCostModel()
    model.observe(8, 0, 0.030)
    for _ in range(20):
        model.observe(8, 16, 0.025)  # measured faster than the decodes alone
    assert model.seconds_per_prefill_token > 0
    assert model.max_prefill_tokens(0.03) < 10**6


def start_decoders(scheduler, rng, num_streams: int = 8):
    decoders = [make_request(f"stream{i}", list(range(1000 + i * 100, 1000 + i * 100 + 64)), 10_000)
                for i in range(num_streams)]
    for request in decoders:
        scheduler.add_request(request)
    for _ in range(20):  # prefill the streams, then decode a while: the model learns both
        run_clocked_step(scheduler, rng)
    assert all(r.num_output_tokens > 0 for r in decoders)
    return decoders


@pytest.mark.parametrize("budget", [AUTO_STEP_BUDGET, 0.060])
def test_a_long_prompt_never_stalls_the_decoding_streams(budget):
    rng = random.Random(2)
    scheduler = make_scheduler(num_blocks=4096, max_num_batched_tokens=512)
    scheduler.max_step_s = budget
    decoders = start_decoders(scheduler, rng)
    decode_only = scheduler.step_cost.decode_s
    long_prompt = make_request("long", [7] * 5500, 4)
    scheduler.add_request(long_prompt)
    limit = 2 * decode_only if budget == AUTO_STEP_BUDGET else budget
    chunk_sizes = []
    step_seconds = []
    while long_prompt.num_output_tokens == 0:
        calibrated = scheduler.step_cost.is_calibrated
        output, seconds = run_clocked_step(scheduler, rng)
        scheduled = {s.request.request_id: s.num_new_tokens for s in output.scheduled}
        # Every stream decodes in every step: none is starved by the prompt.
        assert all(scheduled.get(r.request_id) == 1 for r in decoders)
        chunk = scheduled.get("long", 0)
        chunk_sizes.append(chunk)
        if not calibrated:
            assert chunk == CALIBRATION_CHUNK
        elif chunk > MIN_PREFILL_CHUNK:  # a chunk at the floor may exceed a budget too small for it
            step_seconds.append(seconds)
        assert len(chunk_sizes) < 2000
    # The streams' own prefill (a prompt-only step) already calibrated the per-token cost.
    assert CALIBRATION_CHUNK not in chunk_sizes[:-1]
    # The estimate lags a context that grows every step by a little: no step goes far over.
    step_seconds.sort()
    assert step_seconds[int(0.95 * len(step_seconds))] <= limit * 1.10
    assert step_seconds[-1] <= limit * 1.5, (step_seconds[-1], limit)
    assert sum(chunk_sizes) == 5500
    # The chunks shrink as the prompt's attention grows (each late token reads more keys).
    assert chunk_sizes[0] > chunk_sizes[-2] >= MIN_PREFILL_CHUNK


def test_a_prompt_alone_prefills_with_the_whole_token_budget():
    rng = random.Random(3)
    scheduler = make_scheduler(num_blocks=4096, max_num_batched_tokens=512)
    start_decoders(scheduler, rng, num_streams=1)
    scheduler.finish("stream0", scheduler.requests["stream0"].status.FINISHED_ABORTED)
    long_prompt = make_request("long", [7] * 2000, 4)
    scheduler.add_request(long_prompt)
    output, _ = run_clocked_step(scheduler, rng)
    assert [s.num_new_tokens for s in output.scheduled] == [512]


def test_without_a_budget_chunks_follow_the_token_budget():
    rng = random.Random(4)
    scheduler = make_scheduler(num_blocks=4096, max_num_batched_tokens=512)
    scheduler.max_step_s = None
    start_decoders(scheduler, rng)
    scheduler.add_request(make_request("long", [7] * 2000, 4))
    output, _ = run_clocked_step(scheduler, rng)
    assert {s.request.request_id: s.num_new_tokens for s in output.scheduled}["long"] == 512 - 8


def test_decodes_are_scheduled_before_an_older_prefill():
    """A prompt admitted before the streams, still prefilling, must not take their budget."""
    rng = random.Random(5)
    scheduler = make_scheduler(num_blocks=4096, max_num_batched_tokens=64)
    scheduler.max_step_s = None
    scheduler.add_request(make_request("long", [7] * 3000, 4))
    run_clocked_step(scheduler, rng)
    streams = [make_request(f"s{i}", [100 + i] * 8, 100) for i in range(4)]
    for request in streams:
        scheduler.add_request(request)
    for _ in range(60):
        decoding = [r for r in streams if r.num_output_tokens > 0 and not r.is_finished]
        output, _ = run_clocked_step(scheduler, rng)
        scheduled = {s.request.request_id: s.num_new_tokens for s in output.scheduled}
        assert all(scheduled.get(r.request_id) == 1 for r in decoding)
        assert sum(scheduled.values()) <= 64
