"""What a simulation reports: latency percentiles, throughput, cache hit rate, per policy.

Owns `LatencyStats`, `PolicyReport` (made by `summarize(result)` from engine.py's
SimulationResult), `Slo` (validated latency targets and `meets`) and the text table. Percentiles
are tools/bench/stats.py's (linear interpolation, as numpy and `tokios bench serve` compute them),
and TTFT / TPOT / end-to-end are defined as `vllm bench serve` defines them: TTFT from arrival to
the first output token, TPOT = (end-to-end - TTFT) / (output tokens - 1) over requests with more
than one output token. Throughput divides by the makespan (first arrival to last finish).
"""

from __future__ import annotations

import dataclasses
import math

from tokios.errors import InvalidRequestError
from tokios.tools.bench.stats import mean, percentile
from tokios.tools.simulate.engine import SimulationResult
from tokios.tools.simulate.workload import NO_PREFIX


@dataclasses.dataclass(frozen=True)
class LatencyStats:
    mean_s: float
    p50_s: float
    p90_s: float
    p99_s: float

    @classmethod
    def of(cls, values: list[float]) -> "LatencyStats":
        ordered = sorted(values)
        return cls(mean(ordered), percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99))


@dataclasses.dataclass(frozen=True)
class PolicyReport:
    policy: str
    num_backends: int
    num_requests: int
    ttft: LatencyStats
    tpot: LatencyStats
    e2e: LatencyStats
    queue_wait: LatencyStats  # arrival to admission
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt and output tokens
    requests_per_s: float
    cache_hit_rate: float  # prompt tokens served from the prefix cache / all prompt tokens
    prefix_hit_rate: float  # requests with a system prompt that found it cached (NaN: none had one)
    mean_utilisation: float  # mean over backends of busy time (any step in flight) / makespan
    max_utilisation: float
    makespan_s: float
    num_backend_steps: int
    num_events: int
    num_prefix_evictions: int
    wall_s: float
    router_counters: dict

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        return {key: (None if isinstance(value, float) and math.isnan(value) else value)
                for key, value in data.items()}


def summarize(result: SimulationResult) -> PolicyReport:
    requests = result.requests
    makespan = result.makespan_s
    ttfts = [r.first_token_s - r.arrival_s for r in requests]
    tpots = [(r.finish_s - r.first_token_s) / (r.output_len - 1) for r in requests if r.output_len > 1]
    num_prompt_tokens = sum(r.prompt_len for r in requests)
    num_output_tokens = sum(r.output_len for r in requests)
    sharing = [r for r in requests if r.prefix_id != NO_PREFIX]
    utilisations = [busy / makespan for busy in result.backend_busy_s] if makespan > 0 else [0.0]
    return PolicyReport(
        policy=result.policy, num_backends=result.num_backends, num_requests=len(requests),
        ttft=LatencyStats.of(ttfts), tpot=LatencyStats.of(tpots),
        e2e=LatencyStats.of([r.finish_s - r.arrival_s for r in requests]),
        queue_wait=LatencyStats.of([r.admitted_s - r.arrival_s for r in requests]),
        output_tokens_per_s=num_output_tokens / makespan if makespan > 0 else math.nan,
        total_tokens_per_s=(num_prompt_tokens + num_output_tokens) / makespan if makespan > 0 else math.nan,
        requests_per_s=len(requests) / makespan if makespan > 0 else math.nan,
        cache_hit_rate=sum(r.num_cached for r in requests) / num_prompt_tokens,
        prefix_hit_rate=sum(1 for r in sharing if r.num_cached > 0) / len(sharing) if sharing else math.nan,
        mean_utilisation=mean(utilisations), max_utilisation=max(utilisations), makespan_s=makespan,
        num_backend_steps=result.num_backend_steps, num_events=result.num_events,
        num_prefix_evictions=result.num_prefix_evictions, wall_s=result.wall_s,
        router_counters=result.router_counters)


@dataclasses.dataclass(frozen=True)
class Slo:
    """Latency targets on the 99th percentiles (None: no target on that figure)."""

    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None

    def __post_init__(self) -> None:
        for field, value in (("slo_ttft_p99", self.ttft_p99_s), ("slo_tpot_p99", self.tpot_p99_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidRequestError(f"{field}: {value!r} must be a number of seconds > 0", param=field)

    @property
    def is_set(self) -> bool:
        return self.ttft_p99_s is not None or self.tpot_p99_s is not None

    def meets(self, report: PolicyReport) -> bool:
        return ((self.ttft_p99_s is None or report.ttft.p99_s <= self.ttft_p99_s)
                and (self.tpot_p99_s is None or report.tpot.p99_s <= self.tpot_p99_s))

    def __str__(self) -> str:
        parts = []
        if self.ttft_p99_s is not None:
            parts.append(f"TTFT p99 <= {format_seconds(self.ttft_p99_s)}")
        if self.tpot_p99_s is not None:
            parts.append(f"TPOT p99 <= {format_seconds(self.tpot_p99_s)}")
        return ", ".join(parts) or "none"


def format_seconds(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    if seconds < 1:
        return f"{seconds * 1e3:,.1f} ms"
    return f"{seconds:,.2f} s"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.1f}%"


REPORT_COLUMNS = ("policy", "backends", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "TPOT p99",
                  "e2e p50", "e2e p99", "out tok/s", "cache hit", "busy")


def report_row(report: PolicyReport) -> list[str]:
    return [report.policy, f"{report.num_backends:,}", format_seconds(report.ttft.p50_s),
            format_seconds(report.ttft.p90_s), format_seconds(report.ttft.p99_s), format_seconds(report.tpot.p50_s),
            format_seconds(report.tpot.p99_s), format_seconds(report.e2e.p50_s), format_seconds(report.e2e.p99_s),
            f"{report.output_tokens_per_s:,.1f}", _percent(report.cache_hit_rate), _percent(report.mean_utilisation)]


def render_rows(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(f"{cell:>{width}}" if index else f"{cell:<{width}}"
                       for index, (cell, width) in enumerate(zip(line, widths)))
             for line in [list(header), *rows]]
    return "\n".join(lines)


def render_reports(reports: list[PolicyReport]) -> str:
    return render_rows(REPORT_COLUMNS, [report_row(report) for report in reports])
