"""The fleet simulator: queueing against closed-form M/M/1, the cost model against tokios plan,
routing, KV admission, determinism, calibration and input validation."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from tokios.cli import main as tokios_main
from tokios.errors import InvalidRequestError
from tokios.tools.plan import formulas
from tokios.tools.plan.hardware import NAME_TO_HARDWARE
from tokios.tools.plan.model_presets import NAME_TO_PRESET
from tokios.tools.plan.capacity import PlanInputs, make_plan
from tokios.tools.simulate.backend import BackendLimits, BatchingBackend, ServiceModel, SimRequest
from tokios.tools.simulate.calibration import MeasuredStep, RooflineMeasurement, fit_efficiency, predicted_seconds
from tokios.tools.simulate.cost_model import BackendCostModel, DecodeRun, Efficiency
from tokios.tools.simulate.engine import FleetSpec, simulate
from tokios.tools.simulate.fleet_search import find_fleet_size
from tokios.tools.simulate.report import Slo, summarize
from tokios.tools.simulate.routing import make_router, parse_policies
from tokios.tools.simulate.workload import NO_PREFIX, LengthDistribution, WorkloadSpec, make_workload

LLAMA_70B = NAME_TO_PRESET["llama-3-70b"]
H100 = NAME_TO_HARDWARE["h100-sxm"]


def _plan_inputs(**changes) -> PlanInputs:
    fields = dict(model=LLAMA_70B, hardware=H100, count=4, tp=4, context_len=LLAMA_70B.max_context_len)
    fields.update(changes)
    return PlanInputs(**fields)


def _cost(**changes) -> BackendCostModel:
    return BackendCostModel.from_plan_inputs(_plan_inputs(**changes))


def _spec(**changes) -> WorkloadSpec:
    fields = dict(rate=1.0, num_requests=100, prompt_len=LengthDistribution.parse("512", field_name="prompt_len"),
                  output_len=LengthDistribution.parse("64", field_name="output_len"))
    fields.update(changes)
    return WorkloadSpec(**fields)


# ---- queueing: one exponential server under Poisson arrivals is M/M/1 --------------------------
# Sample sizes: at utilisation 0.8 successive waits are strongly correlated, so the mean of 50,000
# scatters by about 3.5% between seeds; 200,000 bring it under 2% (max 3.5% over 8 seeds), so a 5%
# tolerance tests the queue rather than the seed.
@pytest.mark.parametrize("utilisation, num_requests", [(0.5, 100_000), (0.8, 200_000)])
def test_exponential_server_matches_mm1_closed_forms(utilisation, num_requests):
    service_rate = 10.0
    arrival_rate = utilisation * service_rate
    workload = make_workload(_spec(rate=arrival_rate, num_requests=num_requests, seed=0))
    result = simulate(workload, FleetSpec(1, ServiceModel.exponential(1 / service_rate)), "rr", seed=0)
    report = summarize(result)
    mean_in_system = 1 / (service_rate - arrival_rate)
    mean_wait = utilisation / (service_rate - arrival_rate)
    assert report.e2e.mean_s == pytest.approx(mean_in_system, rel=0.05)
    assert report.queue_wait.mean_s == pytest.approx(mean_wait, rel=0.05)
    assert report.mean_utilisation == pytest.approx(utilisation, rel=0.02)
    # Time in system of M/M/1 FCFS is exponential: its median is ln 2 times its mean.
    assert report.e2e.p50_s == pytest.approx(math.log(2) * mean_in_system, rel=0.05)


# ---- the cost model is tokios plan's arithmetic ---------------------------------------------------
@pytest.mark.parametrize("batch_size, context_len", [(1, 4096), (16, 2048), (256, 8192)])
def test_decode_step_equals_plan(batch_size, context_len):
    cost = _cost()
    plan = make_plan(_plan_inputs(concurrency=batch_size, context_len=context_len), with_suggestions=False)
    assert cost.decode_step_seconds(batch_size, context_len) == pytest.approx(plan.concurrency_tpot_s, rel=1e-12)
    assert cost.decode_step_seconds(1, context_len) == pytest.approx(plan.batch1_tpot_s, rel=1e-12)


@pytest.mark.parametrize("prompt_len", [1, 512, 2048, 8000])
def test_prefill_equals_plan_ttft_floor(prompt_len):
    cost = _cost()
    plan = make_plan(_plan_inputs(prompt_len=prompt_len), with_suggestions=False)
    assert cost.prefill_seconds(prompt_len) == pytest.approx(plan.ttft_floor_s, rel=1e-12)
    assert cost.kv_capacity_tokens == plan.kv_capacity_tokens
    assert cost.kv_bytes_per_token == plan.kv_bytes_per_token


def test_chunks_of_a_prompt_add_up_to_the_whole_prefill_flops():
    cost = _cost()
    chunks = [(0, 512, False), (512, 512, False), (1024, 1000, True)]
    flops = sum(cost.prefill_chunk_work(n, done, ends)[0] for done, n, ends in chunks)
    assert flops == pytest.approx(formulas.prefill_flops(LLAMA_70B, 2024), rel=1e-12)


def test_single_request_alone_gets_plan_ttft_and_decode_steps():
    cost = _cost()
    limits = BackendLimits(max_num_seqs=8, max_num_batched_tokens=4096)
    workload = make_workload(_spec(num_requests=1, prompt_len=LengthDistribution.parse("2048", field_name="p"),
                                   output_len=LengthDistribution.parse("100", field_name="o")))
    request = simulate(workload, FleetSpec(1, ServiceModel.batching(cost, limits)), "rr").requests[0]
    plan = make_plan(_plan_inputs(prompt_len=2048), with_suggestions=False)
    assert request.first_token_s - request.arrival_s == pytest.approx(plan.ttft_floor_s, rel=1e-9)
    # 99 decode steps at contexts 2049 .. 2147 (prompt plus the tokens so far)
    expected = sum(cost.decode_step_seconds(1, 2048 + j) for j in range(1, 100))
    assert request.finish_s - request.first_token_s == pytest.approx(expected, rel=1e-9)


def test_decode_run_closed_form_equals_the_sum_of_its_steps_across_the_ridge():
    cost = _cost(model=NAME_TO_PRESET["llama-3-8b"], count=1, tp=1)
    batch_size, total_context, num_steps = 400, 400, 3000
    run = DecodeRun(cost, batch_size, total_context)
    assert run.compute0 > run.memory0  # starts compute-bound ...
    last = num_steps - 1
    assert run.memory0 + run.memory_slope * last > run.compute0 + run.compute_slope * last  # ... ends memory-bound
    brute = [cost.decode_step_seconds(batch_size, (total_context + batch_size * j) / batch_size) for j in range(num_steps)]
    for k in (1, 7, 1000, num_steps):
        assert run.elapsed_s(k) == pytest.approx(sum(brute[:k]), rel=1e-9)
    assert run.steps_done_by(sum(brute[:1234]) + 1e-12, num_steps) == 1234


def test_efficiency_scales_the_roofs():
    cost = _cost()
    slow = cost.with_efficiency(Efficiency(prefill_compute=0.5, decode_compute=0.1, bandwidth=0.25,
                                           step_overhead_s=0.001))
    assert slow.decode_step_seconds(1, 1024) == pytest.approx(4 * cost.decode_step_seconds(1, 1024) + 0.001, rel=1e-9)
    assert slow.prefill_seconds(8000) == pytest.approx(2 * cost.prefill_seconds(8000) + 0.001, rel=1e-9)
    compute_bound = 256 * formulas.decode_step_flops(LLAMA_70B, 1, 16) / (0.1 * cost.peak_flops)
    assert slow.decode_step_seconds(256, 16) == pytest.approx(max(compute_bound, 4 * (
        cost.decode_step_seconds(256, 16))) + 0.001, rel=1e-9)


# ---- routing -----------------------------------------------------------------------------------
def _request(prompt_len=2048, prefix_id=NO_PREFIX) -> SimRequest:
    return SimRequest(0, 0.0, prompt_len, 16, prefix_id)


def test_round_robin_cycles():
    router = make_router("rr", [0, 0, 0])
    assert [router.choose(_request()) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_busy_picks_the_least_loaded_and_follows_changes():
    loads = [3, 1, 2]
    router = make_router("least-busy", loads)
    assert router.choose(_request()) == 1
    loads[1] = 5
    router.on_load_change(1)
    assert router.choose(_request()) == 2
    loads[0] = 0
    router.on_load_change(0)
    assert router.choose(_request()) == 0


def test_prefix_aware_follows_the_prefix_then_falls_back_when_imbalanced():
    loads = [0] * 4
    router = make_router("prefix", loads, cacheable_prefix_len=1024)

    def route(request) -> int:
        backend_id = router.choose(request)
        loads[backend_id] += 1
        router.on_load_change(backend_id)
        return backend_id

    first = route(_request(prefix_id=5))
    for backend_id in range(4):  # make the holder the busiest, within the balance thresholds
        if backend_id != first:
            loads[backend_id] = 0
    loads[first] = 60
    router.on_load_change(first)
    assert route(_request(prefix_id=5)) == first  # holds prefix 5: affinity wins over load
    assert route(_request(prefix_id=6)) != first  # another prefix: least-busy
    assert route(_request(prompt_len=4096, prefix_id=5)) != first  # 1024 / 4096 < 30%: least-busy
    loads[first] = 100  # 100 - 0 > 64 and 100 > 1.5 x 0: imbalanced
    router.on_load_change(first)
    assert route(_request(prefix_id=5)) != first
    assert router.num_imbalanced == 1


def test_prefix_policy_hits_the_cache_more_on_a_large_fleet():
    cost = _cost()
    limits = BackendLimits(max_num_seqs=256, max_num_batched_tokens=8192)
    workload = make_workload(_spec(rate=40.0, num_requests=1500, prompt_len=LengthDistribution.parse("2048", field_name="p"),
                                   output_len=LengthDistribution.parse("64", field_name="o"), shared_prefix_share=0.5,
                                   num_shared_prefixes=8, shared_prefix_len=1024, seed=1))
    fleet = FleetSpec(32, ServiceModel.batching(cost, limits))
    prefix = summarize(simulate(workload, fleet, "prefix"))
    least_busy = summarize(simulate(workload, fleet, "least-busy"))
    assert prefix.prefix_hit_rate > 0.95
    assert prefix.cache_hit_rate > least_busy.cache_hit_rate + 0.05
    num_sharing = sum(1 for p in workload.prefix_ids if p != NO_PREFIX)
    assert prefix.cache_hit_rate <= num_sharing * 1024 / sum(workload.prompt_lens)  # system prompts only


# ---- KV capacity -------------------------------------------------------------------------------
def test_kv_capacity_makes_requests_wait_and_is_never_exceeded():
    cost = dataclasses.replace(_cost(), kv_capacity_tokens=2 * 1024 + 15)  # room for two requests of 1,024
    backend = BatchingBackend(0, cost, BackendLimits(max_num_seqs=16, max_num_batched_tokens=4096), shared_prefix_len=0)
    requests = [SimRequest(i, 0.0, 1000, 24, NO_PREFIX) for i in range(5)]
    next_event_s = None
    for request in requests:
        next_event_s = backend.add_request(request, 0.0) or next_event_s
    max_running = 0
    while next_event_s is not None:
        assert backend.num_private_blocks <= backend.num_capacity_blocks
        max_running = max(max_running, len(backend.running))
        _, next_event_s = backend.on_event(next_event_s)
    assert max_running == 2
    assert all(r.finish_s is not None for r in requests)
    first_finish = min(r.finish_s for r in requests)
    assert sorted(r.admitted_s for r in requests)[2] >= first_finish
    assert backend.num_private_blocks == 0


def test_a_request_larger_than_the_kv_cache_is_refused():
    cost = dataclasses.replace(_cost(), kv_capacity_tokens=512)
    workload = make_workload(_spec(num_requests=3))
    with pytest.raises(InvalidRequestError) as error:
        simulate(workload, FleetSpec(1, ServiceModel.batching(cost)), "rr")
    assert error.value.param == "prompt_len"


# ---- determinism, workload ---------------------------------------------------------------------
def _dict_without_wall(report) -> dict:
    data = report.to_dict()
    data.pop("wall_s")
    return data


def test_same_seed_same_results_other_seed_other_results():
    service = ServiceModel.batching(_cost(), BackendLimits(max_num_seqs=64, max_num_batched_tokens=2048))

    def run(seed: int):
        workload = make_workload(_spec(rate=20.0, num_requests=300, shared_prefix_share=0.5, num_shared_prefixes=4,
                                       shared_prefix_len=256, arrival="bursty", burstiness=0.5, seed=seed,
                                       prompt_len=LengthDistribution.parse("lognormal:400:0.5:4000", field_name="p")))
        return [_dict_without_wall(summarize(simulate(workload, FleetSpec(3, service), p, seed=seed)))
                for p in ("rr", "least-busy", "prefix")]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_bursty_arrivals_keep_the_rate_and_raise_the_variance():
    def gaps(arrival: str) -> list[float]:
        times = make_workload(_spec(rate=5.0, num_requests=20_000, arrival=arrival, burstiness=0.25)).arrival_s
        return [b - a for a, b in zip([0.0] + times, times)]

    poisson, bursty = gaps("poisson"), gaps("bursty")
    for sample, squared_cv in ((poisson, 1.0), (bursty, 4.0)):
        assert statistics.fmean(sample) == pytest.approx(0.2, rel=0.05)
        assert statistics.pvariance(sample) / statistics.fmean(sample) ** 2 == pytest.approx(squared_cv, rel=0.1)


def test_shared_prefix_share_and_lengths():
    workload = make_workload(_spec(num_requests=4000, shared_prefix_share=0.3, num_shared_prefixes=5,
                                   shared_prefix_len=100, prompt_len=LengthDistribution.parse("200:300", field_name="p")))
    sharing = [p for p in workload.prefix_ids if p != NO_PREFIX]
    assert len(sharing) / 4000 == pytest.approx(0.3, abs=0.03)
    assert set(sharing) == set(range(5))
    assert min(workload.prompt_lens) >= 200 and max(workload.prompt_lens) <= 300


# ---- fleet size ----------------------------------------------------------------------------------
def test_find_fleet_size_returns_the_smallest_fleet_meeting_the_slo():
    service = ServiceModel.batching(_cost(), BackendLimits(max_num_seqs=64, max_num_batched_tokens=4096))
    spec = _spec(rate=30.0, num_requests=600, prompt_len=LengthDistribution.parse("2048", field_name="p"),
                 output_len=LengthDistribution.parse("128", field_name="o"))
    slo = Slo(ttft_p99_s=0.5, tpot_p99_s=0.03)
    search = find_fleet_size(spec, service, "least-busy", slo, max_backends=64)
    assert search.num_backends is not None and search.num_backends > 1
    assert search.size_to_meets[search.num_backends] is True
    assert search.size_to_meets[search.num_backends - 1] is False


# ---- calibration ---------------------------------------------------------------------------------
def test_fit_recovers_known_efficiencies():
    hardware = dataclasses.replace(NAME_TO_HARDWARE["l4"], name="this-machine", is_measured=True)
    truth = Efficiency(prefill_compute=0.4, decode_compute=0.08, bandwidth=0.6, step_overhead_s=0.002)
    peak, bandwidth = hardware.peak_flops("bf16"), hardware.memory_bandwidth
    shapes = [("prefill", 2e12, 2e8), ("prefill", 8e12, 3e8), ("prefill", 5e11, 2e8),
              ("decode", 1e10, 1.5e10), ("decode", 2e11, 1.6e10), ("decode", 8e11, 1.8e10), ("decode", 2e12, 2e10)]
    steps = [MeasuredStep(phase, f"{phase} {i}", flops, num_bytes, predicted_seconds(
        MeasuredStep(phase, "", flops, num_bytes, 1.0), peak, bandwidth, truth))
             for i, (phase, flops, num_bytes) in enumerate(shapes)]
    calibration = fit_efficiency(RooflineMeasurement(hardware, "bf16", "bfloat16", steps))
    assert calibration.efficiency.prefill_compute == pytest.approx(0.4, rel=0.02)
    assert calibration.efficiency.decode_compute == pytest.approx(0.08, rel=0.02)
    assert calibration.efficiency.bandwidth == pytest.approx(0.6, rel=0.02)
    assert calibration.efficiency.step_overhead_s == pytest.approx(0.002, rel=0.1)
    assert calibration.rms_log_error < 0.01


# ---- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make, field", [
    (lambda: _spec(rate=-1.0), "rate"),
    (lambda: _spec(num_requests=0), "num_requests"),
    (lambda: _spec(shared_prefix_share=1.5), "shared_prefix_share"),
    (lambda: _spec(shared_prefix_share=0.5, shared_prefix_len=512), "shared_prefix_len"),
    (lambda: _spec(arrival="zipf"), "arrival"),
    (lambda: FleetSpec(0, ServiceModel.exponential(1.0)), "num_backends"),
    (lambda: parse_policies("rr,fastest"), "policies"),
    (lambda: LengthDistribution.parse("lognormal:0:1", field_name="prompt_len"), "prompt_len"),
    (lambda: LengthDistribution.parse("9:3", field_name="output_len"), "output_len"),
    (lambda: BackendLimits(max_num_seqs=64, max_num_batched_tokens=32), "max_num_batched_tokens"),
    (lambda: Efficiency(decode_compute=0.0), "decode_compute_efficiency"),
    (lambda: Slo(ttft_p99_s=-2.0), "slo_ttft_p99"),
])
def test_bad_input_raises_naming_the_field(make, field):
    with pytest.raises(InvalidRequestError) as error:
        make()
    assert error.value.param == field
    assert field in error.value.message


def test_cli_reports_bad_flags_in_one_line(capsys):
    base = ["simulate", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--no-chart", "--num-requests", "5"]
    assert tokios_main(base + ["--rate", "-3"]) == 1
    assert "rate" in capsys.readouterr().err
    assert tokios_main(base + ["--num-backends", "0"]) == 1
    assert "num_backends" in capsys.readouterr().err
    assert tokios_main(base + ["--policies", "random"]) == 1
    assert "policies" in capsys.readouterr().err


def test_cli_runs_every_policy_and_prints_json(capsys):
    import json

    argv = ["simulate", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--no-chart", "--json", "--num-requests",
            "200", "--rate", "20", "--num-backends", "2", "--shared-prefix-share", "0.5", "--shared-prefix-len", "256",
            "--prompt-len", "1024", "--output-len", "32"]
    assert tokios_main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in payload["reports"]] == ["rr", "least-busy", "prefix"]
    assert all(r["num_requests"] == 200 and r["ttft"]["p99_s"] > 0 for r in payload["reports"])


# ---- replaying bench serve runs ------------------------------------------------------------------
def _bench_json(path, *, label="rate=2/s", num_prompts=10, seed=0) -> str:
    import json

    level = {"label": label, "num_failed": 0, "output_throughput": 100.0,
             "ttft": {"median_ms": 50.0, "p99_ms": 90.0}, "tpot": {"median_ms": 10.0, "p99_ms": 20.0}}
    load = {"input_len": "128", "output_len": "16", "seed": seed, "num_prompts": num_prompts, "ignore_eos": True}
    path.write_text(json.dumps({"load": load, "levels": [level]}))
    return str(path)


def test_replay_reuses_the_prompts_an_earlier_run_sent(tmp_path):
    from tokios.tools.simulate.replay import load_bench_run, replay_bench_runs

    runs = [load_bench_run(_bench_json(tmp_path / "a.json")), load_bench_run(_bench_json(tmp_path / "b.json"))]
    slow_prefill = Efficiency(prefill_compute=0.01)  # so that a prefill's time follows its tokens
    service = ServiceModel.batching(_cost(model=NAME_TO_PRESET["llama-3-8b"], count=1, tp=1).with_efficiency(slow_prefill))
    first, second = replay_bench_runs(runs, service)
    assert first.num_requests == second.num_requests == 10
    cached_share = 112 / 128  # all whole blocks of a 128-token prompt but the one with its last token
    assert first.cache_hit_rate == pytest.approx(cached_share / 10)  # only prompt 0, sent by the warm-up
    assert second.cache_hit_rate == pytest.approx(cached_share)
    assert second.ttft.p50_s < first.ttft.p50_s


def test_replay_refuses_a_concurrency_level(tmp_path):
    from tokios.tools.simulate.replay import load_bench_run

    with pytest.raises(InvalidRequestError) as error:
        load_bench_run(_bench_json(tmp_path / "c.json", label="c=4"))
    assert error.value.param == "validate_against"
