"""Replay `tokios bench serve` runs in the simulator, to compare its predictions with a real server.

Owns `BenchRun` (one rate level of a `tokios bench serve --json` file: its load and what it
measured; `load_bench_run`), `replay_bench_runs(runs, service)` and `render_validation`. The
runs are replayed in the order given, on one backend, as they ran against one server:

- each run's requests are bench serve's own: prompt i of a seed is the same text in every run
  (tools/bench/serve.py build_requests), so the simulator gives it the same prompt id, and a
  prompt sent before (by an earlier run, or as this run's warm-up) finds its whole blocks in the
  prefix cache, less the last token, which must be computed;
- before its timed requests each run sends its first prompt once with at most 8 output tokens
  (the warm-up), and waits for it;
- the timed arrivals are bench serve's Poisson draws, reproduced exactly: the first request at
  once, then gaps from random.Random(seed + 1).expovariate(rate).
Runs are placed far apart, so each starts on an idle backend. Only fixed prompt and output
lengths and rate levels (not concurrency-capped ones) are replayable.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

from tokios.errors import InvalidRequestError
from tokios.tools.bench.prompts import LengthSpec
from tokios.tools.simulate.backend import ServiceModel
from tokios.tools.simulate.engine import FleetSpec, simulate
from tokios.tools.simulate.report import PolicyReport, format_seconds, render_rows, summarize
from tokios.tools.simulate.workload import LengthDistribution, Workload, WorkloadSpec

_RATE_LABEL = re.compile(r"rate=([0-9.eE+-]+)/s$")
_WARMUP_MAX_TOKENS = 8  # bench_serve.run_level's warm-up
_RUN_SPACING_S = 100_000.0  # between replayed runs: each starts on an idle backend


@dataclasses.dataclass(frozen=True)
class BenchRun:
    path: str
    rate: float
    num_prompts: int
    prompt_len: int
    output_len: int
    seed: int
    measured_ttft_p50_s: float
    measured_ttft_p99_s: float
    measured_tpot_p50_s: float
    measured_tpot_p99_s: float
    measured_output_tokens_per_s: float


def load_bench_run(path: str) -> BenchRun:
    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"validate_against: {path}: {why}", param="validate_against")

    try:
        record = json.loads(Path(path).read_text())
        load, levels = record["load"], record["levels"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise refuse(f"not the --json output of `tokios bench serve` ({exc})") from None
    if len(levels) != 1:
        raise refuse(f"holds {len(levels)} levels; replay one rate level per file")
    level = levels[0]
    match = _RATE_LABEL.match(str(level.get("label", "")))
    if match is None:
        raise refuse(f"level {level.get('label')!r} is not a --request-rate level (concurrency-capped runs are closed "
                     "loops, which the simulator does not model)")
    prompt_len = LengthSpec.parse(load["input_len"], field_name="validate_against")
    output_len = LengthSpec.parse(load["output_len"], field_name="validate_against")
    if prompt_len.low != prompt_len.high or output_len.low != output_len.high or not load.get("ignore_eos", True):
        raise refuse("replay needs fixed --input-len and --output-len, with EOS ignored")
    if level["num_failed"]:
        raise refuse(f"{level['num_failed']} requests failed")
    return BenchRun(path=str(path), rate=float(match.group(1)), num_prompts=int(load["num_prompts"]),
                    prompt_len=prompt_len.low, output_len=output_len.low, seed=int(load["seed"]),
                    measured_ttft_p50_s=level["ttft"]["median_ms"] / 1e3,
                    measured_ttft_p99_s=level["ttft"]["p99_ms"] / 1e3,
                    measured_tpot_p50_s=level["tpot"]["median_ms"] / 1e3,
                    measured_tpot_p99_s=level["tpot"]["p99_ms"] / 1e3,
                    measured_output_tokens_per_s=level["output_throughput"])


def replay_bench_runs(runs: list[BenchRun], service: ServiceModel) -> list[PolicyReport]:
    """One report per run, of its timed requests only."""
    prompt_key_to_id: dict[tuple[int, int, int], int] = {}
    arrival_s, prompt_lens, output_lens, prefix_ids, run_indexes = [], [], [], [], []
    longest_prompt = max(run.prompt_len for run in runs)
    for run_index, run in enumerate(runs):
        start = run_index * _RUN_SPACING_S
        # The warm-up: the run's first prompt, waited for before the timed requests start.
        warmup_s = (service.cost.prefill_seconds(run.prompt_len)
                    + _WARMUP_MAX_TOKENS * service.cost.decode_step_seconds(1, run.prompt_len)) * 2 + 1.0
        times = [start, start + warmup_s]
        gaps = random.Random(run.seed + 1)
        for _ in range(run.num_prompts - 1):
            times.append(times[-1] + gaps.expovariate(run.rate))
        for position, time_s in enumerate(times):
            prompt_index = max(0, position - 1)  # the warm-up sends prompt 0
            key = (run.seed, run.prompt_len, prompt_index)
            prefix_ids.append(prompt_key_to_id.setdefault(key, len(prompt_key_to_id)))
            arrival_s.append(time_s)
            prompt_lens.append(run.prompt_len)
            output_lens.append(min(run.output_len, _WARMUP_MAX_TOKENS) if position == 0 else run.output_len)
            run_indexes.append(run_index if position else -1)
    # Every prompt is its own "system prompt" of all its tokens but the last, so a repeat reuses
    # its whole blocks, as the engine's prefix cache does.
    spec = WorkloadSpec(rate=1.0, num_requests=len(arrival_s),
                        prompt_len=LengthDistribution.parse(str(longest_prompt), field_name="prompt_len"),
                        output_len=LengthDistribution.parse("1", field_name="output_len"),
                        shared_prefix_share=1.0, num_shared_prefixes=max(1, len(prompt_key_to_id)),
                        shared_prefix_len=min(run.prompt_len for run in runs) - 1)
    workload = Workload(spec, arrival_s, prompt_lens, output_lens, prefix_ids)
    result = simulate(workload, FleetSpec(1, service), "rr")
    reports = []
    for run_index in range(len(runs)):
        timed = [r for r, index in zip(result.requests, run_indexes) if index == run_index]
        reports.append(summarize(dataclasses.replace(result, requests=timed)))
    return reports


def _error(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.0f}%"


def render_validation(runs: list[BenchRun], reports: list[PolicyReport]) -> str:
    rows = []
    for run, report in zip(runs, reports):
        name = f"{Path(run.path).name} ({run.rate:g} req/s, {run.num_prompts} x {run.prompt_len}+{run.output_len})"
        for metric, measured, predicted, as_text in (
                ("TTFT p50", run.measured_ttft_p50_s, report.ttft.p50_s, format_seconds),
                ("TTFT p99", run.measured_ttft_p99_s, report.ttft.p99_s, format_seconds),
                ("TPOT p50", run.measured_tpot_p50_s, report.tpot.p50_s, format_seconds),
                ("TPOT p99", run.measured_tpot_p99_s, report.tpot.p99_s, format_seconds),
                ("output tok/s", run.measured_output_tokens_per_s, report.output_tokens_per_s, lambda v: f"{v:,.1f}")):
            rows.append([name, metric, as_text(measured), as_text(predicted), _error(predicted, measured)])
            name = ""
    return render_rows(["bench run", "figure", "measured", "simulated", "error"], rows)
