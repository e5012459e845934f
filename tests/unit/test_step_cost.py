"""Fair chunked prefill: the step cost model (scheduler/step_cost.py) and the scheduler's chunks
under a step time budget, driven by a synthetic clock whose cost is known exactly.

The clock charges each step TRUE_COST (a fixed weights read, a per-row matmul cost and a
per-pair attention cost, the shape a CPU decode step has) plus a little noise; the scheduler
only sees the measured seconds, as it does in the engine.

Layer slices (a long prompt's chunk run through some layers a step) are driven by a second
clock, pass_seconds, where each chunk pays a pass's fixed cost (its context's KV read), the
shape that makes whole chunks at the floor overrun the budget late in a long prompt.
"""

from __future__ import annotations

import random

import pytest

from tokios.request import RequestStatus
from tokios.scheduler.scheduler import AUTO_STEP_BUDGET, CALIBRATION_CHUNK, MIN_PREFILL_CHUNK, Scheduler
from tokios.scheduler.step_cost import StepCostModel
from tests.unit.test_scheduler import check_step, fake_next_token, make_request, make_scheduler

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


# ---- layer slices ------------------------------------------------------------------------------
NUM_LAYERS = 30


def pass_seconds(output) -> tuple[float, float, float]:
    """The engine's shape late in a long prompt: decodes and whole short chunks share one pass
    (the weights read once), but each prompt chunk reads its context's KV once per pass, which
    a few tokens cannot share out; a layer slice is a pass of its own over its share of the
    layers, paying that share of the weights, the KV read and the rows. The decodes' KV reads
    grow with their context, as the streams' do while a long prompt is prefilled. Returns (the
    step, its decodes alone, its layer slices alone)."""
    decodes, others, slices = 0.020, 0.0, 0.0
    for s in output.scheduled:
        context = s.request.num_computed_tokens
        if not s.is_prefill:
            decodes += s.num_new_tokens * (0.0015 + 2e-6 * context)
            continue
        chunk = 1e-5 * context + s.num_new_tokens * (0.0015 + 4e-7 * context)
        if s.layer_slice is None:
            others += chunk
        else:
            slices += s.layer_slice.fraction * (0.012 + chunk)
    return decodes + others + slices, decodes, slices


def run_long_prompt_among_streams(slices: bool, num_blocks: int = 4096, prompt_len: int = 5500, probe=None):
    """8 streams decode; a prompt_len-token prompt arrives. Returns (the long prompt's step
    entries, (step seconds, its decodes' seconds) of the steps that carried a chunk of it, the
    scheduler)."""
    rng = random.Random(7)
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=512)
    scheduler.max_step_s = AUTO_STEP_BUDGET
    scheduler.num_sliceable_layers = NUM_LAYERS if slices else None
    decoders = start_decoders(scheduler, rng)
    long_prompt = make_request("long", [7] * prompt_len, 4)
    scheduler.add_request(long_prompt)
    entries, timings = [], []
    while long_prompt.num_output_tokens == 0:
        output = scheduler.schedule()
        scheduled = {s.request.request_id: s for s in output.scheduled}
        assert all(scheduled[r.request_id].num_new_tokens == 1 for r in decoders if not r.is_finished)
        noise = 1 + rng.uniform(-0.03, 0.03)
        seconds, decode_seconds, slice_seconds = (noise * t for t in pass_seconds(output))
        scheduler.observe_step(output, seconds, slice_seconds)
        if "long" in scheduled:
            entries.append((scheduled["long"].num_new_tokens, scheduled["long"].layer_slice,
                            scheduled["long"].samples_this_step))
            timings.append((seconds, decode_seconds))
        sampled = {s.request.request_id: [fake_next_token(s.request)] for s in output.scheduled if s.samples_this_step}
        scheduler.update(output, sampled)
        if probe is not None:
            probe(scheduler, long_prompt, scheduled.get("long"))
        assert len(entries) < 5000
    return entries, timings, scheduler


def test_layer_slices_keep_a_long_prompt_within_the_budget_where_whole_chunks_cannot():
    """--max-step-ms auto: a step with a chunk of the prompt may take twice its decodes' time."""
    sliced, sliced_timings, scheduler = run_long_prompt_among_streams(slices=True)
    whole, whole_timings, _ = run_long_prompt_among_streams(slices=False)
    # Whole chunks: late in the prompt even the floor's 4 tokens cost more than the budget.
    assert all(layer_slice is None for _, layer_slice, _ in whole)
    whole_ratios = sorted(seconds / decodes for seconds, decodes in whole_timings)
    assert whole_ratios[int(0.95 * len(whole_ratios))] > 2 * 1.1
    # Layer slices: every step within the budget (the estimate lags a little), to the end, with
    # the budget following the decodes as their contexts grow (timed apart from the slices).
    ratios = sorted(seconds / decodes for seconds, decodes in sliced_timings)
    assert ratios[int(0.95 * len(ratios))] <= 2 * 1.10
    assert ratios[-1] <= 2 * 1.5, ratios[-1]
    last_decodes = sliced_timings[-1][1]
    assert sliced_timings[0][1] * 1.2 < last_decodes  # the streams' own steps did slow
    assert scheduler.step_cost.decode_s == pytest.approx(last_decodes, rel=0.1)
    # ... and the prompt is done in fewer steps: each slice's pass serves 32 tokens, not 4.
    assert len(sliced) < 0.8 * len(whole)
    # Whole chunks until the floor no longer fits, then layer slices: each chunk's slices cover
    # the layers in order, and the tokens count once, when a chunk's last layer is done.
    first_slice = next(i for i, (_, layer_slice, _) in enumerate(sliced) if layer_slice is not None)
    assert first_slice > 0 and all(layer_slice is None for _, layer_slice, _ in sliced[:first_slice])
    next_layer, chunk_tokens, computed = 0, None, sum(n for n, _, _ in sliced[:first_slice])
    for num_tokens, layer_slice, samples in sliced[first_slice:]:
        assert layer_slice is not None and layer_slice.num_layers == NUM_LAYERS
        assert layer_slice.start == next_layer < layer_slice.stop
        if next_layer == 0:
            chunk_tokens = num_tokens
        assert num_tokens == chunk_tokens
        next_layer = layer_slice.stop % NUM_LAYERS
        if layer_slice.is_last:
            computed += num_tokens
        assert samples == (layer_slice.is_last and computed == 5500)
    assert computed == 5500 and next_layer == 0
    assert max(layer_slice.stop - layer_slice.start for _, layer_slice, _ in sliced[first_slice:]) > 1


def test_a_chunk_part_way_through_its_layers_is_not_in_the_prefix_cache():
    """Its later layers' K/V are not written yet: a prompt with the same prefix must not find
    those blocks until the chunk's last slice."""
    seen = {"part_way": 0, "completed": 0}

    def probe(scheduler, long_prompt, entry):
        same_prefix = make_request(f"probe{seen['part_way'] + seen['completed']}", [7] * 5500, 1)
        _, num_cached = scheduler.kv.get_computed_blocks(same_prefix)
        computed_blocks = long_prompt.num_computed_tokens // 16
        assert num_cached <= computed_blocks * 16
        if entry is not None and entry.layer_slice is not None:
            if entry.layer_slice.is_last:
                seen["completed"] += 1
                assert num_cached == computed_blocks * 16
            else:
                seen["part_way"] += 1

    run_long_prompt_among_streams(slices=True, prompt_len=2500, probe=probe)
    assert seen["part_way"] > 10 and seen["completed"] > 2


def test_a_request_preempted_part_way_through_its_layers_starts_its_chunk_again():
    """A pool too small for the streams to grow beside the long prompt: the newest request (the
    long prompt) is preempted, some of the times part-way through a chunk's layers; every step
    stays consistent and every request's tokens equal a run without pressure."""
    preempted_part_way = []
    original_preempt = Scheduler._preempt

    def preempt(self, request, output):
        progress = self._slicing.get(request.request_id)
        if progress is not None and progress[1] > 0:
            preempted_part_way.append(progress)
        original_preempt(self, request, output)

    def run(num_blocks: int) -> dict[str, list[int]]:
        rng = random.Random(11)
        scheduler = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=512)
        scheduler.max_step_s = AUTO_STEP_BUDGET
        scheduler.num_sliceable_layers = NUM_LAYERS
        requests = [make_request(f"stream{i}", list(range(1000 + i * 100, 1000 + i * 100 + 64)), 600)
                    for i in range(4)]
        for request in requests:
            scheduler.add_request(request)
        for _ in range(12):
            run_clocked_step(scheduler, rng)
        requests.append(make_request("long", list(range(20_000, 23_000)), 8))
        scheduler.add_request(requests[-1])
        for _ in range(20_000):
            if not scheduler.num_unfinished:
                break
            output = scheduler.schedule()
            check_step(scheduler, output)
            seconds, _, slice_seconds = pass_seconds(output)
            scheduler.observe_step(output, seconds, slice_seconds)
            scheduler.update(output, {s.request.request_id: [fake_next_token(s.request)]
                                      for s in output.scheduled if s.samples_this_step})
        scheduler.check_invariants()
        return {r.request_id: r.output_token_ids for r in requests}

    Scheduler._preempt = preempt
    try:
        # 280 blocks: the streams grow to 4 x 42 blocks beside the prompt's 188 (found by trying).
        pressured = run(num_blocks=280)
    finally:
        Scheduler._preempt = original_preempt
    assert preempted_part_way, "no preemption hit a chunk part-way through its layers"
    assert pressured == run(num_blocks=4096)


def test_an_abort_part_way_through_a_chunks_layers_frees_everything():
    aborted = []

    def probe(scheduler, long_prompt, entry):
        if aborted or entry is None or entry.layer_slice is None or entry.layer_slice.is_last:
            return
        scheduler.finish("long", RequestStatus.FINISHED_ABORTED)
        aborted.append(long_prompt)
        assert "long" not in scheduler._slicing
        # Its computed blocks stay cached for others; the chunk's own never joined the cache.
        _, num_cached = scheduler.kv.get_computed_blocks(make_request("same", [9] * 3000, 1))
        assert num_cached == long_prompt.num_computed_tokens // 16 * 16 > 0
        scheduler.check_invariants()
        output = scheduler.schedule()
        assert output.finished_request_ids == ["long"] and "long" not in {s.request.request_id for s in output.scheduled}

    rng = random.Random(5)
    scheduler = make_scheduler(num_blocks=4096, max_num_batched_tokens=512)
    scheduler.max_step_s = AUTO_STEP_BUDGET
    scheduler.num_sliceable_layers = NUM_LAYERS
    start_decoders(scheduler, rng)
    long_prompt = make_request("long", [9] * 3000, 4)
    scheduler.add_request(long_prompt)
    while not aborted:
        output = scheduler.schedule()
        seconds, _, slice_seconds = pass_seconds(output)
        scheduler.observe_step(output, seconds, slice_seconds)
        scheduler.update(output, {s.request.request_id: [fake_next_token(s.request)]
                                  for s in output.scheduled if s.samples_this_step})
        entry = next((s for s in output.scheduled if s.request.request_id == "long"), None)
        probe(scheduler, long_prompt, entry)
    assert aborted[0].status == RequestStatus.FINISHED_ABORTED
