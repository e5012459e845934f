"""`tokios simulate`: the command line of the fleet simulator, its tables, JSON and charts.

Owns the arguments and the three modes: simulate each policy on a fleet of --num-backends
(default), --find-backends (the fewest backends meeting an SLO at --rate, per policy) and
--sweep-rates (that for each rate: the fleet-size curves). The backend comes from `tokios plan`'s
inputs (--model, --hardware, --tp, --weight-bits, --kv-dtype) or, measured, from the JSON that
`tokios roofline --json` prints (--roofline-json: this machine's roofs plus efficiencies fitted
to the engine's steps, calibration.py). The simulation itself is engine.py; no torch is imported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from tokios.config import parse_size
from tokios.errors import InvalidRequestError
from tokios.gateway.router import PrefixPolicy
from tokios.tools.simulate.backend import BackendLimits, ServiceModel
from tokios.tools.simulate.cost_model import BackendCostModel, Efficiency
from tokios.tools.simulate.engine import FleetSpec, check_num_backends, simulate
from tokios.tools.simulate.fleet_search import FleetSearch, find_fleet_size, sweep_rates
from tokios.tools.simulate.report import (PolicyReport, Slo, format_seconds, render_reports, render_rows,
                                          report_row, REPORT_COLUMNS, summarize)
from tokios.tools.simulate.routing import POLICY_NAMES, parse_policies
from tokios.tools.simulate.workload import ARRIVAL_KINDS, LengthDistribution, WorkloadSpec, make_workload

_DEFAULTS = BackendLimits()
_PREFIX_DEFAULTS = PrefixPolicy()


def _float_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must be a comma-separated list of numbers > 0")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokios.tools.plan.hardware import HARDWARE_NAMES
    from tokios.tools.plan.model_presets import NAME_TO_PRESET
    from tokios.tools.plan.capacity import KV_DTYPES

    backend = parser.add_argument_group("backend (one replica: a model on a tensor-parallel group)")
    backend.add_argument("--model", default=None,
                         help=f"GGUF file, HF directory or preset ({', '.join(NAME_TO_PRESET)}); "
                         "default: the bundled SmolLM2-135M GGUF")
    backend.add_argument("--hardware", default=None, choices=HARDWARE_NAMES,
                         help="hardware preset (default this-machine: measured once and cached, as tokios plan)")
    backend.add_argument("--roofline-json", default=None, metavar="PATH",
                         help="a measured backend: the output of `tokios roofline --json` (this machine's roofs, "
                         "and compute/bandwidth efficiencies and a per-step overhead fitted to its engine points)")
    backend.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: devices per backend (default 1)")
    backend.add_argument("--weight-bits", default=None,
                         help="bits per weight (number, or fp16, int8, q4_1...); default: as stored, 16 for a preset")
    backend.add_argument("--kv-dtype", default="fp16", choices=KV_DTYPES)
    backend.add_argument("--compute-dtype", default=None, choices=["fp32", "bf16", "fp16", "fp8", "int8"],
                         help="which matmul roof a step is held to (default as tokios plan, or the roofline's)")
    backend.add_argument("--headroom", type=float, default=0.10, help="memory kept free per device (default 0.10)")
    backend.add_argument("--kv-cache-memory", default=None,
                         help="KV cache per backend, e.g. 512MiB (default: what tokios plan leaves after weights)")
    backend.add_argument("--prefill-compute-efficiency", type=float, default=None,
                         help="share of the FLOP/s roof prompt tokens attain (default 1, or fitted by --roofline-json)")
    backend.add_argument("--decode-compute-efficiency", type=float, default=None,
                         help="share of the FLOP/s roof decode rows attain (default 1, or fitted)")
    backend.add_argument("--bandwidth-efficiency", type=float, default=None,
                         help="share of the bandwidth roof a step attains (default 1, or fitted)")
    backend.add_argument("--step-overhead-ms", type=float, default=None,
                         help="fixed cost of every step (default 0, or fitted)")
    backend.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs,
                         help=f"requests running at once per backend (default {_DEFAULTS.max_num_seqs}, as tokios serve)")
    backend.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens,
                         help=f"token budget per step (default {_DEFAULTS.max_num_batched_tokens}, as tokios serve)")
    backend.add_argument("--block-size", type=int, default=_DEFAULTS.block_size,
                         help=f"KV block size in tokens (default {_DEFAULTS.block_size})")
    backend.add_argument("--max-step-ms", default="off",
                         help="a step's time budget when it carries decodes, as tokios serve --max-step-ms "
                         "(default off: the token budget alone, as vLLM)")
    backend.add_argument("--no-prefix-caching", action="store_true", help="backends keep no prefix cache")

    fleet = parser.add_argument_group("fleet and routing")
    fleet.add_argument("--num-backends", "--backends", dest="num_backends", type=int, default=1,
                       help="backends in the fleet (default 1)")
    fleet.add_argument("--policies", default=",".join(POLICY_NAMES),
                       help=f"routing policies to compare on the same workload (default {','.join(POLICY_NAMES)})")
    fleet.add_argument("--prefix-match-threshold", type=float, default=_PREFIX_DEFAULTS.cache_threshold,
                       help="prefix: route to a holder when its cached prefix covers at least this share of the "
                       f"prompt (default {_PREFIX_DEFAULTS.cache_threshold}, SGLang's)")
    fleet.add_argument("--balance-rel-threshold", type=float, default=_PREFIX_DEFAULTS.balance_rel_threshold,
                       help="prefix: least-busy while the busiest backend has more than this times the idlest's "
                       f"load ... (default {_PREFIX_DEFAULTS.balance_rel_threshold})")
    fleet.add_argument("--balance-abs-threshold", type=int, default=_PREFIX_DEFAULTS.balance_abs_threshold,
                       help=f"... and more than this many requests more (default {_PREFIX_DEFAULTS.balance_abs_threshold})")

    load = parser.add_argument_group("workload")
    load.add_argument("--arrival", default="poisson", choices=ARRIVAL_KINDS)
    load.add_argument("--burstiness", type=float, default=0.25,
                      help="bursty: gamma shape of the gaps, 1 is Poisson, smaller is burstier (default 0.25)")
    load.add_argument("--rate", type=float, default=1.0, help="requests per second (default 1)")
    size = load.add_mutually_exclusive_group()
    size.add_argument("--num-requests", type=int, default=None, help="requests to simulate (default 1000)")
    size.add_argument("--duration", type=float, default=None,
                      help="seconds of arrivals instead: rate x duration requests (per rate with --sweep-rates)")
    load.add_argument("--prompt-len", default="512", help="N, LOW:HIGH or lognormal:MEDIAN:SIGMA[:MAX] (default 512)")
    load.add_argument("--output-len", default="128", help="same forms (default 128)")
    load.add_argument("--shared-prefix-share", type=float, default=0.0,
                      help="share of requests whose prompt starts with a shared system prompt (default 0)")
    load.add_argument("--num-shared-prefixes", type=int, default=8, help="K system prompts, chosen uniformly (default 8)")
    load.add_argument("--shared-prefix-len", type=int, default=1024, help="tokens of each system prompt (default 1024)")
    load.add_argument("--seed", type=int, default=0)

    slo = parser.add_argument_group("SLO and fleet size")
    slo.add_argument("--slo-ttft-p99", type=float, default=None, help="seconds")
    slo.add_argument("--slo-tpot-p99", type=float, default=None, help="seconds")
    slo.add_argument("--find-backends", action="store_true",
                     help="find the fewest backends meeting the SLO at --rate, per policy (doubling, then bisection)")
    slo.add_argument("--sweep-rates", type=_float_list, default=None, metavar="R1,R2,...",
                     help="find the fewest backends for each rate: the fleet-size curves")
    slo.add_argument("--max-backends", type=int, default=10_000, help="largest fleet a search tries (default 10000)")

    check = parser.add_argument_group("validation")
    check.add_argument("--validate-against", default=None, metavar="BENCH.json,...",
                       help="replay these `tokios bench serve --request-rate R --json` files (in the order they ran "
                       "against one server) on one simulated backend and print predicted against measured")

    out = parser.add_argument_group("output")
    out.add_argument("--chart", default=None,
                     help="PNG path (default: simulate.png or simulate-fleet.png in the tokios cache, "
                     "~/.cache/tokios or $TOKIOS_CACHE_DIR)")
    out.add_argument("--no-chart", action="store_true", help="draw no chart")
    out.add_argument("--json", action="store_true", help="print JSON instead of tables")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


# ---- building the pieces from the arguments ------------------------------------------------------
def _max_step_s(text: str) -> float | None:
    if str(text).strip().lower() in ("off", "none", ""):
        return None
    try:
        return float(text) / 1e3
    except ValueError:
        raise InvalidRequestError(f"max_step_ms: {text!r} must be a number of milliseconds or 'off'",
                                  param="max_step_ms") from None


def build_service(args: argparse.Namespace):
    """(ServiceModel, the fitted Calibration or None)."""
    from tokios.tools.plan.hardware import THIS_MACHINE, load_hardware
    from tokios.tools.plan.model_presets import load_model_shape
    from tokios.tools.plan.capacity import PlanInputs, parse_weight_bits
    from tokios.tools.plan.cli import default_model
    from tokios.tools.simulate.calibration import evaluate_efficiency, fit_efficiency, load_roofline_json

    calibration = None
    compute_dtype = args.compute_dtype
    if args.roofline_json:
        if args.hardware is not None:
            raise InvalidRequestError("hardware: give either --hardware or --roofline-json (its roofs are the "
                                      "hardware)", param="hardware")
        measurement = load_roofline_json(args.roofline_json)
        hardware = measurement.hardware
        compute_dtype = compute_dtype or measurement.roof_dtype
        calibration = fit_efficiency(measurement)
        fitted = calibration.efficiency
    else:
        hardware = load_hardware(args.hardware or THIS_MACHINE)
        fitted = Efficiency()
    def chosen(flag_value: float | None, fitted_value: float) -> float:
        return fitted_value if flag_value is None else flag_value

    efficiency = Efficiency(
        prefill_compute=chosen(args.prefill_compute_efficiency, fitted.prefill_compute),
        decode_compute=chosen(args.decode_compute_efficiency, fitted.decode_compute),
        bandwidth=chosen(args.bandwidth_efficiency, fitted.bandwidth),
        step_overhead_s=chosen(None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3,
                               fitted.step_overhead_s))
    model = load_model_shape(args.model or default_model())
    inputs = PlanInputs(model=model, hardware=hardware, count=args.tp, tp=args.tp,
                        weight_bits=parse_weight_bits(args.weight_bits) if args.weight_bits else None,
                        kv_dtype=args.kv_dtype, context_len=model.max_context_len, compute_dtype=compute_dtype,
                        headroom=args.headroom)
    kv_cache_bytes = parse_size(args.kv_cache_memory, field_name="kv_cache_memory") if args.kv_cache_memory else None
    if calibration is not None and efficiency != calibration.efficiency:
        calibration = evaluate_efficiency(measurement, efficiency, is_fitted=False)
    cost = BackendCostModel.from_plan_inputs(inputs, efficiency=efficiency, kv_cache_bytes=kv_cache_bytes)
    limits = BackendLimits(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           block_size=args.block_size, max_step_s=_max_step_s(args.max_step_ms),
                           enable_prefix_caching=not args.no_prefix_caching)
    return ServiceModel.batching(cost, limits), calibration


def build_workload_spec(args: argparse.Namespace, rate: float | None = None) -> WorkloadSpec:
    rate = args.rate if rate is None else rate
    if args.duration is not None:
        if not (math.isfinite(args.duration) and args.duration > 0):
            raise InvalidRequestError(f"duration: {args.duration!r} must be a number of seconds > 0", param="duration")
        num_requests = max(1, math.ceil(rate * args.duration)) if rate > 0 else 1
    else:
        num_requests = 1000 if args.num_requests is None else args.num_requests
    return WorkloadSpec(
        rate=rate, num_requests=num_requests,
        prompt_len=LengthDistribution.parse(args.prompt_len, field_name="prompt_len"),
        output_len=LengthDistribution.parse(args.output_len, field_name="output_len"),
        arrival=args.arrival, burstiness=args.burstiness if args.arrival == "bursty" else 1.0,
        shared_prefix_share=args.shared_prefix_share, num_shared_prefixes=args.num_shared_prefixes,
        shared_prefix_len=args.shared_prefix_len if args.shared_prefix_share > 0 else 0, seed=args.seed)


# ---- the command ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    slo = Slo(args.slo_ttft_p99, args.slo_tpot_p99)
    prefix_options = PrefixPolicy(cache_threshold=args.prefix_match_threshold,
                                  balance_abs_threshold=args.balance_abs_threshold,
                                  balance_rel_threshold=args.balance_rel_threshold)
    if (args.find_backends or args.sweep_rates) and not slo.is_set:
        raise InvalidRequestError("slo_ttft_p99: --find-backends and --sweep-rates need --slo-ttft-p99 and/or "
                                  "--slo-tpot-p99", param="slo_ttft_p99")
    check_num_backends(args.num_backends)  # before any work
    if args.validate_against:
        return run_validation(args)
    workload_spec = build_workload_spec(args)
    service, calibration = build_service(args)
    progress = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    header = describe(service, workload_spec, args, calibration)

    if args.sweep_rates:
        searches = sweep_rates(workload_spec, args.sweep_rates, policies, service, slo,
                               duration_s=args.duration, max_backends=args.max_backends,
                               prefix_options=prefix_options, progress=progress)
        body = render_sweep(searches, policies)
        chart = _chart(args, "simulate-fleet.png", lambda path, draw: draw.draw_fleet_chart(
            searches, slo, path, title=_title(service, workload_spec, slo, sweep=True)))
        payload = {"searches": [search.to_dict() for search in searches]}
    elif args.find_backends:
        searches = [find_fleet_size(workload_spec, service, policy, slo, max_backends=args.max_backends,
                                    prefix_options=prefix_options, progress=progress) for policy in policies]
        body = render_searches(searches)
        reports = [search.report for search in searches if search.report is not None]
        chart = _chart(args, "simulate.png", lambda path, draw: draw.draw_policy_chart(
            reports, path, title=_title(service, workload_spec, slo))) if reports else None
        payload = {"searches": [search.to_dict() for search in searches]}
    else:
        fleet = FleetSpec(args.num_backends, service)
        workload = make_workload(workload_spec)
        reports = []
        for policy in policies:
            reports.append(summarize(simulate(workload, fleet, policy, prefix_options=prefix_options,
                                              seed=args.seed)))
        body = render_reports(reports) + "\n\n" + render_run_costs(reports)
        if slo.is_set:
            body += "\n" + "\n".join(f"SLO ({slo}) met by {r.policy}: {'yes' if slo.meets(r) else 'no'}"
                                     for r in reports)
        chart = _chart(args, "simulate.png", lambda path, draw: draw.draw_policy_chart(
            reports, path, title=_title(service, workload_spec, slo)))
        payload = {"reports": [report.to_dict() for report in reports]}

    if args.json:
        payload.update(backend=backend_dict(service), workload=workload_dict(workload_spec),
                       calibration=calibration.to_dict() if calibration else None,
                       slo={"ttft_p99_s": slo.ttft_p99_s, "tpot_p99_s": slo.tpot_p99_s},
                       chart=str(chart) if chart else None)
        print(json.dumps(payload, indent=2))
    else:
        print(header + "\n\n" + body + (f"\n\nchart: {chart}" if chart else ""))
    return 0


def run_validation(args: argparse.Namespace) -> int:
    from tokios.tools.simulate.replay import load_bench_run, render_validation, replay_bench_runs

    runs = [load_bench_run(path.strip()) for path in args.validate_against.split(",") if path.strip()]
    service, calibration = build_service(args)
    reports = replay_bench_runs(runs, service)
    if args.json:
        print(json.dumps({"backend": backend_dict(service),
                          "calibration": calibration.to_dict() if calibration else None,
                          "runs": [dataclasses.asdict(run) for run in runs],
                          "reports": [report.to_dict() for report in reports]}, indent=2))
        return 0
    header = describe_backend(service, args, calibration, mean_prompt=runs[0].prompt_len)
    print(header + "\n\n" + render_validation(runs, reports))
    return 0


def _chart(args: argparse.Namespace, default_name: str, draw_with):
    if args.no_chart:
        return None
    from tokios.model_files import cache_directory
    from tokios.tools.simulate import chart

    return draw_with(args.chart or cache_directory() / default_name, chart)


def _title(service: ServiceModel, spec: WorkloadSpec, slo: Slo, *, sweep: bool = False) -> str:
    cost = service.cost
    rate = "" if sweep else f" at {spec.rate:g} req/s"
    shared = (f", {spec.shared_prefix_share:.0%} share one of {spec.num_shared_prefixes} x {spec.shared_prefix_len}"
              if spec.uses_shared_prefixes else "")
    return (f"{cost.model.name} on {cost.tp} x {cost.hardware_name} per backend; SLO {slo}\n"
            f"prompts {spec.prompt_len}, outputs {spec.output_len}{shared}{rate}")


# ---- text ----------------------------------------------------------------------------------------
def describe(service: ServiceModel, spec: WorkloadSpec, args: argparse.Namespace, calibration) -> str:
    return describe_backend(service, args, calibration, mean_prompt=max(1, round(spec.prompt_len.mean))) \
        + "\n" + describe_workload(spec, sweep_rates=args.sweep_rates, duration_s=args.duration)


def describe_backend(service: ServiceModel, args: argparse.Namespace, calibration, *, mean_prompt: int) -> str:
    cost, limits = service.cost, service.limits
    efficiency = cost.efficiency
    source = "measured roofs (tokios roofline)" if args.roofline_json else "roofline"
    lines = [
        f"backend: {cost.model.name} on {cost.tp} x {cost.hardware_name}, {cost.compute_dtype} "
        f"{cost.peak_flops / 1e12:,.3f} TFLOP/s, {cost.memory_bandwidth / 1e9:,.1f} GB/s ({source}); "
        f"efficiency: prefill compute {efficiency.prefill_compute:.3f}, decode compute "
        f"{efficiency.decode_compute:.3f}, bandwidth {efficiency.bandwidth:.3f}, step overhead "
        f"{efficiency.step_overhead_s * 1e3:.2f} ms",
        f"         KV cache {cost.kv_capacity_tokens:,} tokens; max_num_seqs {limits.max_num_seqs}, "
        f"max_num_batched_tokens {limits.max_num_batched_tokens}, block {limits.block_size}, max step "
        f"{'off' if limits.max_step_s is None else format_seconds(limits.max_step_s)}, prefix caching "
        f"{'on' if limits.enable_prefix_caching else 'off'}",
        f"         alone: a {mean_prompt:,}-token prompt {format_seconds(cost.prefill_seconds(mean_prompt))}, "
        f"a decode step at batch 1 {format_seconds(cost.decode_step_seconds(1, mean_prompt))}",
    ]
    if calibration is not None:
        how = "fitted to" if calibration.is_fitted else "given efficiencies against"
        lines.append(f"calibration ({how} {args.roofline_json}, rms log error {calibration.rms_log_error:.3f}):")
        lines += [f"  {label:<26} predicted {format_seconds(predicted):>10}  measured {format_seconds(measured):>10}"
                  f"  ({100 * (predicted / measured - 1):+.0f}%)" for label, predicted, measured in calibration.residuals]
    return "\n".join(lines)


def describe_workload(spec: WorkloadSpec, *, sweep_rates: list[float] | None = None,
                      duration_s: float | None = None) -> str:
    if sweep_rates:
        count = f"{duration_s:g} s of requests" if duration_s else f"{spec.num_requests:,} requests"
        rates = f"each of {', '.join(f'{rate:g}' for rate in sorted(sweep_rates))} req/s"
    else:
        count, rates = f"{spec.num_requests:,} requests", f"{spec.rate:g} req/s"
    return (f"workload: {count}, {spec.arrival}"
            + (f" (burstiness {spec.burstiness:g})" if spec.arrival == "bursty" else "")
            + f" at {rates}; prompt {spec.prompt_len}, output {spec.output_len} tokens"
            + (f"; {spec.shared_prefix_share:.0%} start with one of {spec.num_shared_prefixes} system prompts of "
               f"{spec.shared_prefix_len:,} tokens" if spec.uses_shared_prefixes else "")
            + f"; seed {spec.seed}")


def render_run_costs(reports: list[PolicyReport]) -> str:
    return "\n".join(f"{r.policy}: {r.num_requests:,} requests on {r.num_backends:,} backends, "
                     f"{r.num_events:,} events, {r.num_backend_steps:,} backend steps, simulated "
                     f"{r.makespan_s:,.1f} s in {r.wall_s:.2f} s" for r in reports)


def render_searches(searches: list[FleetSearch]) -> str:
    rows = []
    for search in searches:
        if search.report is None:
            rows.append([search.policy, f"> {max(search.size_to_meets):,}"] + ["-"] * (len(REPORT_COLUMNS) - 2))
        else:
            rows.append(report_row(search.report))
    tried = "\n".join(f"{s.policy}: sizes tried " + ", ".join(f"{size:,}{'' if meets else ' (miss)'}"
                                                          for size, meets in sorted(s.size_to_meets.items()))
                      for s in searches)
    return render_rows(REPORT_COLUMNS, rows) + "\n\n" + tried


def render_sweep(searches: list[FleetSearch], policies: list[str]) -> str:
    rates = sorted({search.rate for search in searches})
    rate_policy_to_search = {(search.rate, search.policy): search for search in searches}
    header = ["req/s"] + [f"{policy}: backends (TTFT p99, TPOT p99, hit)" for policy in policies]
    rows = []
    for rate in rates:
        row = [f"{rate:g}"]
        for policy in policies:
            search = rate_policy_to_search[(rate, policy)]
            if search.report is None:
                row.append(f"> {max(search.size_to_meets):,}")
            else:
                report = search.report
                row.append(f"{search.num_backends:,} ({format_seconds(report.ttft.p99_s)}, "
                           f"{format_seconds(report.tpot.p99_s)}, {100 * report.cache_hit_rate:.0f}%)")
        rows.append(row)
    return render_rows(header, rows)


def backend_dict(service: ServiceModel) -> dict:
    cost, limits = service.cost, service.limits
    return {"model": cost.model.name, "hardware": cost.hardware_name, "tp": cost.tp,
            "compute_dtype": cost.compute_dtype, "peak_flops": cost.peak_flops,
            "memory_bandwidth": cost.memory_bandwidth, "step_weight_bytes": cost.step_weight_bytes,
            "expert_weight_bytes": cost.expert_weight_bytes,
            "kv_bytes_per_token": cost.kv_bytes_per_token, "kv_capacity_tokens": cost.kv_capacity_tokens,
            "prefill_compute_efficiency": cost.efficiency.prefill_compute,
            "decode_compute_efficiency": cost.efficiency.decode_compute,
            "bandwidth_efficiency": cost.efficiency.bandwidth,
            "step_overhead_s": cost.efficiency.step_overhead_s, "max_num_seqs": limits.max_num_seqs,
            "max_num_batched_tokens": limits.max_num_batched_tokens, "block_size": limits.block_size,
            "max_step_s": limits.max_step_s, "enable_prefix_caching": limits.enable_prefix_caching}


def workload_dict(spec: WorkloadSpec) -> dict:
    return {"rate": spec.rate, "num_requests": spec.num_requests, "arrival": spec.arrival,
            "burstiness": spec.burstiness, "prompt_len": str(spec.prompt_len), "output_len": str(spec.output_len),
            "shared_prefix_share": spec.shared_prefix_share, "num_shared_prefixes": spec.num_shared_prefixes,
            "shared_prefix_len": spec.shared_prefix_len, "seed": spec.seed}
