"""Statistics for the benchmarks: percentiles, repeated-measurement summaries, serving metrics.

Pure Python on lists of floats, so every figure the benchmark commands print can be checked by a
unit test on hand-made inputs. The serving metrics follow the definitions of `vllm bench serve`:
TTFT is request start to first content chunk; TPOT is (end-to-end - TTFT) / (output tokens - 1);
ITL is the gap between consecutive content chunks; throughput divides by the whole run's duration.
Used by serve.py (per-request records -> ServeSummary) and offline.py / prefix.py (reps).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

SERVE_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method); NaN for an empty list."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in 0..100, got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(frozen=True)
class RepeatedFigure:
    """One figure measured several times (e.g. decode tok/s over 5 reps)."""

    median: float
    p5: float
    p95: float
    num_reps: int

    @classmethod
    def of(cls, samples: list[float]) -> "RepeatedFigure":
        return cls(median=percentile(samples, 50), p5=percentile(samples, 5),
                   p95=percentile(samples, 95), num_reps=len(samples))


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either side is missing or the denominator is 0."""
    if denominator == 0 or math.isnan(numerator) or math.isnan(denominator):
        return math.nan
    return numerator / denominator


@dataclass
class RequestRecord:
    """What the load generator saw of one request (times are time.perf_counter() seconds)."""

    start_time: float
    end_time: float = 0.0
    is_success: bool = False
    error: str = ""
    # perf_counter time of each streamed chunk that carried generated text/tokens.
    chunk_times: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft_s(self) -> float:
        return self.chunk_times[0] - self.start_time if self.chunk_times else math.nan

    @property
    def e2e_latency_s(self) -> float:
        return self.end_time - self.start_time

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; NaN for single-token outputs."""
        if self.num_output_tokens < 2 or not self.chunk_times:
            return math.nan
        return (self.e2e_latency_s - self.ttft_s) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass(frozen=True)
class LatencySummary:
    mean_ms: float
    median_ms: float
    p90_ms: float
    p95_ms: float
    p99_ms: float

    @classmethod
    def of_seconds(cls, values_s: list[float]) -> "LatencySummary":
        values_ms = [v * 1000.0 for v in values_s if not math.isnan(v)]
        return cls(mean_ms=mean(values_ms), median_ms=percentile(values_ms, 50),
                   p90_ms=percentile(values_ms, 90), p95_ms=percentile(values_ms, 95),
                   p99_ms=percentile(values_ms, 99))


@dataclass(frozen=True)
class ServeSummary:
    """The figures `vllm bench serve` prints, for one load level."""

    label: str
    num_completed: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    peak_concurrency: int
    ttft: LatencySummary
    tpot: LatencySummary
    itl: LatencySummary
    e2e_latency: LatencySummary
    errors: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def peak_concurrency(records: list[RequestRecord]) -> int:
    """Most requests in flight at one instant (an end at the same instant as a start comes first)."""
    events = sorted([(r.start_time, 1) for r in records] + [(r.end_time, -1) for r in records])
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    return peak


def summarize_serve(label: str, records: list[RequestRecord], duration_s: float) -> ServeSummary:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    completed = [r for r in records if r.is_success]
    failed = [r for r in records if not r.is_success]
    total_input = sum(r.num_prompt_tokens for r in completed)
    total_output = sum(r.num_output_tokens for r in completed)
    # Keep the distinct error messages (first few) so a run of failures explains itself.
    distinct_errors = list(dict.fromkeys(r.error for r in failed))[:5]
    return ServeSummary(
        label=label,
        num_completed=len(completed),
        num_failed=len(failed),
        duration_s=duration_s,
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(completed) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        peak_concurrency=peak_concurrency(records),
        ttft=LatencySummary.of_seconds([r.ttft_s for r in completed]),
        tpot=LatencySummary.of_seconds([r.tpot_s for r in completed]),
        itl=LatencySummary.of_seconds([gap for r in completed for gap in r.itls_s]),
        e2e_latency=LatencySummary.of_seconds([r.e2e_latency_s for r in completed]),
        errors=distinct_errors,
    )
