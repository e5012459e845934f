"""Scheduler + KVCacheManager driven with fake sampled tokens (no model): chunked prefill under
the token budget, preemption by recompute, prefix hits, aborts, and a property test that any
mix of requests finishes with the same tokens as without memory pressure.

The fake "model" picks each next token from the whole token history, so a request whose
history were corrupted by preemption or chunking would produce different tokens.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokios.kv_cache.manager import KVCacheManager
from tokios.request import Request, RequestStatus
from tokios.sampling_params import SamplingParams
from tokios.scheduler.scheduler import Scheduler, SchedulerOutput

BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id, list(prompt_token_ids), params, max_tokens)


def fake_next_token(request: Request) -> int:
    return (sum(request.all_token_ids) * 7 + request.num_tokens) % 5000 + 1000


def make_scheduler(num_blocks: int, max_num_batched_tokens: int = 512, max_num_seqs: int = 16,
                   enable_prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching, cache_salt="test")
    return Scheduler(kv, max_num_seqs, max_num_batched_tokens, MAX_MODEL_LEN)


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What must hold for every step the scheduler hands to a runner."""
    assert output.num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(output.scheduled) <= scheduler.max_num_seqs
    scheduled_ids = [s.request.request_id for s in output.scheduled]
    assert len(scheduled_ids) == len(set(scheduled_ids))
    for scheduled in output.scheduled:
        request = scheduled.request
        assert scheduled.num_new_tokens >= 1
        end = request.num_computed_tokens + scheduled.num_new_tokens
        assert end <= request.num_tokens
        # The block table covers every position this step writes.
        assert len(scheduled.block_tables[0]) * BLOCK_SIZE >= end
        assert scheduled.block_tables == scheduler.kv.block_tables(request.request_id)
        assert request.status == RequestStatus.RUNNING
    scheduler.kv.check_invariants()


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step; output.sampled_request_ids records who got a token (samples_this_step
    is only meaningful before update advances the computed counts)."""
    output = scheduler.schedule()
    check_step(scheduler, output)
    sampled = {s.request.request_id: [fake_next_token(s.request)] for s in output.scheduled if s.samples_this_step}
    output.sampled_request_ids = set(sampled)
    scheduler.update(output, sampled)
    return output


def run_to_completion(scheduler: Scheduler, requests: list[Request], max_steps: int = 10_000) -> dict[str, list[int]]:
    for request in requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        run_step(scheduler)
    else:
        raise AssertionError("scheduler made no progress: requests left " + str(sorted(scheduler.requests)))
    scheduler.check_invariants()
    return {r.request_id: r.output_token_ids for r in requests}


def test_long_prompt_is_prefilled_in_chunks_while_the_running_decode_advances_every_step():
    scheduler = make_scheduler(64, max_num_batched_tokens=32)
    decoding = make_request("decode", list(range(8)), max_tokens=20)
    scheduler.add_request(decoding)
    first = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in first.scheduled] == [("decode", 8)]

    long_prompt = make_request("long", list(range(100, 200)), max_tokens=2)
    scheduler.add_request(long_prompt)
    chunks = []
    while long_prompt.num_output_tokens == 0:
        output = run_step(scheduler)
        new_tokens = {s.request.request_id: s for s in output.scheduled}
        assert new_tokens["decode"].num_new_tokens == 1  # never stalled by the long prompt
        chunk = new_tokens["long"]
        is_last_chunk = chunk.num_new_tokens == 100 - sum(chunks)
        assert ("long" in output.sampled_request_ids) == is_last_chunk
        chunks.append(chunk.num_new_tokens)
        assert output.num_scheduled_tokens <= 32
    assert chunks == [31, 31, 31, 7]
    assert decoding.num_output_tokens == 1 + len(chunks)
    run_to_completion(scheduler, [])
    assert decoding.status == RequestStatus.FINISHED_LENGTH and decoding.num_output_tokens == 20


def test_waiting_prompts_share_what_the_budget_leaves():
    scheduler = make_scheduler(64, max_num_batched_tokens=32)
    for name in ("a", "b"):
        scheduler.add_request(make_request(name, [ord(name)] * 20, max_tokens=1))
    output = run_step(scheduler)
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("a", 20), ("b", 12)]
    output = run_step(scheduler)
    # a finished (max_tokens 1); b continues where its first chunk stopped.
    assert [(s.request.request_id, s.num_new_tokens) for s in output.scheduled] == [("b", 8)]
    run_to_completion(scheduler, [])


def test_max_num_seqs_limits_how_many_run_at_once():
    scheduler = make_scheduler(64, max_num_seqs=2)
    requests = [make_request(f"r{i}", [i] * 5, max_tokens=3) for i in range(3)]
    for request in requests:
        scheduler.add_request(request)
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    run_to_completion(scheduler, [])
    assert all(r.num_output_tokens == 3 for r in requests)


def test_preemption_with_ten_blocks_and_two_requests_of_80_tokens():
    scheduler = make_scheduler(10)
    first = make_request("first", list(range(80)), max_tokens=8)
    second = make_request("second", list(range(1000, 1080)), max_tokens=8)
    for request in (first, second):
        scheduler.add_request(request)

    step_one = run_step(scheduler)  # both prompts fill the pool exactly: 5 + 5 blocks
    assert [(s.request.request_id, s.num_new_tokens) for s in step_one.scheduled] == [("first", 80), ("second", 80)]
    assert scheduler.kv.block_ids("first") == [0, 1, 2, 3, 4]
    assert scheduler.kv.block_ids("second") == [5, 6, 7, 8, 9]
    assert scheduler.kv.pool.num_free_blocks == 0

    late = make_request("late", list(range(5000, 5016)), max_tokens=4)
    scheduler.add_request(late)
    step_two = run_step(scheduler)  # first needs a 6th block: the newest (second) gives way
    assert step_two.preempted_request_ids == ["second"]
    assert [s.request.request_id for s in step_two.scheduled] == ["first"]
    assert second.status == RequestStatus.PREEMPTED and second.num_computed_tokens == 0
    assert second.num_output_tokens == 1  # its generated token is kept and recomputed later
    assert [r.request_id for r in scheduler.waiting] == ["second", "late"]  # ahead of new arrivals
    # second freed tail first: first took block 9, second's first four blocks stay cached.
    assert scheduler.kv.block_ids("first") == [0, 1, 2, 3, 4, 9]

    first_step_of: dict[str, int] = {}
    step_index = 2
    while scheduler.num_unfinished:
        output = run_step(scheduler)
        step_index += 1
        for scheduled in output.scheduled:
            first_step_of.setdefault(scheduled.request.request_id, step_index)
    scheduler.check_invariants()
    assert first_step_of["second"] <= first_step_of["late"]
    assert second.num_cached_tokens == 0 and second.num_preemptions == 1
    assert scheduler.num_preemptions == 1

    unpressured = run_to_completion(make_scheduler(100), [
        make_request("first", list(range(80)), max_tokens=8),
        make_request("second", list(range(1000, 1080)), max_tokens=8),
        make_request("late", list(range(5000, 5016)), max_tokens=4)])
    assert {r.request_id: r.output_token_ids for r in (first, second, late)} == unpressured
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in (first, second, late))


def test_a_request_starts_only_when_its_whole_prompt_fits_beside_the_running_ones():
    """Chunked prefill admitted requests by their first chunk: four 80-token prompts in a pool
    for two all started, outgrew it and preempted each other. Admission counts whole prompts
    (prefix hits spared), so two run, the others wait, and nobody is recomputed."""
    scheduler = make_scheduler(12, max_num_batched_tokens=32)
    requests = [make_request(f"r{i}", list(range(i * 1000, i * 1000 + 80)), max_tokens=4) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    most_running = 0
    while scheduler.num_unfinished:
        run_step(scheduler)
        most_running = max(most_running, len(scheduler.running))
    scheduler.check_invariants()
    assert most_running == 2 and scheduler.num_preemptions == 0
    unpressured = run_to_completion(make_scheduler(100, max_num_batched_tokens=32), [
        make_request(f"r{i}", list(range(i * 1000, i * 1000 + 80)), max_tokens=4) for i in range(4)])
    assert {r.request_id: r.output_token_ids for r in requests} == unpressured
    # A prompt sharing a running request's prefix needs only its own blocks: it starts where
    # another would wait. (An idle cached prefix saves compute, not room: its blocks leave the
    # free pool like new ones.)
    scheduler = make_scheduler(9)
    prompt = list(range(80))
    for request in [make_request("a", prompt, max_tokens=4), make_request("same", prompt[:64] + [7] * 16, max_tokens=4),
                    make_request("b", list(range(6000, 6080)), max_tokens=4)]:
        scheduler.add_request(request)
    output = run_step(scheduler)
    assert [s.request.request_id for s in output.scheduled] == ["a", "same"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]  # 5 blocks, 3 left
    assert scheduler.requests["same"].num_cached_tokens == 64


def test_prefix_hit_skips_the_cached_blocks():
    scheduler = make_scheduler(32)
    shared = list(range(40))
    run_to_completion(scheduler, [make_request("a", shared + [1, 2], max_tokens=2)])
    again = make_request("b", shared + [3, 4, 5], max_tokens=2)
    scheduler.add_request(again)
    output = run_step(scheduler)
    # All the shared 40 tokens: two full blocks, and 8 tokens of a's third block (a's last, never
    # filled: cached as its tail when a finished), copied into b's own block.
    assert again.num_cached_tokens == 40
    assert output.scheduled[0].num_new_tokens == 43 - 40
    assert len(output.block_copies) == 1
    run_to_completion(scheduler, [])


def test_abort_frees_blocks_and_is_reported_to_the_next_step():
    scheduler = make_scheduler(16)
    running = make_request("running", list(range(30)), max_tokens=50)
    waiting = make_request("waiting", list(range(30)), max_tokens=50)
    scheduler.add_request(running)
    run_step(scheduler)
    scheduler.add_request(waiting)
    assert scheduler.finish("running", RequestStatus.FINISHED_ABORTED) is running
    assert scheduler.finish("running", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    output = scheduler.schedule()
    assert output.finished_request_ids == ["running"]
    assert [s.request.request_id for s in output.scheduled] == ["waiting"]
    assert scheduler.finish("waiting", RequestStatus.FINISHED_ABORTED) is waiting
    scheduler.check_invariants()
    assert scheduler.kv.pool.num_used_blocks == 0


prompt_strategy = st.tuples(
    st.sampled_from([[], list(range(7, 7 + 16)), list(range(300, 340))]),  # shared prefixes
    st.lists(st.integers(0, 9), min_size=1, max_size=40),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(st.tuples(prompt_strategy, st.integers(1, 24), st.integers(0, 6)), min_size=1, max_size=8),
    num_blocks=st.integers(6, 24),
    max_num_batched_tokens=st.sampled_from([8, 16, 33, 512]),
    max_num_seqs=st.integers(1, 5),
    enable_prefix_caching=st.booleans(),
)
def test_any_mix_finishes_with_the_same_tokens_as_without_pressure(
        specs, num_blocks, max_num_batched_tokens, max_num_seqs, enable_prefix_caching):
    def build() -> list[tuple[int, Request]]:
        built = []
        for index, ((prefix, suffix), max_tokens, arrival_step) in enumerate(specs):
            prompt = prefix + suffix
            max_tokens = min(max_tokens, num_blocks * BLOCK_SIZE - len(prompt))  # always fits alone
            built.append((arrival_step, make_request(f"r{index}", prompt, max_tokens)))
        return built

    def run(scheduler: Scheduler) -> dict[str, list[int]]:
        pending = build()
        requests = [r for _, r in pending]
        step = 0
        while pending or scheduler.num_unfinished:
            for arrival_step, request in [p for p in pending if p[0] <= step]:
                scheduler.add_request(request)
                pending.remove((arrival_step, request))
            run_step(scheduler)
            step += 1
            assert step < 5000, "no progress"
        scheduler.check_invariants()
        assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)
        return {r.request_id: r.output_token_ids for r in requests}

    pressured = run(make_scheduler(num_blocks, max_num_batched_tokens, max_num_seqs, enable_prefix_caching))
    reference = run(make_scheduler(1000))
    assert pressured == reference
