"""Prometheus metrics of the server, named `tokios:*` (vLLM's names with our prefix).

Owns one CollectorRegistry per app (so several apps in one process do not collide): latency
histograms and per-request counters that the server observes as requests finish, plus a
collector that reads the engine's cumulative EngineStats at scrape time (running/waiting
requests, KV cache usage, token, prefix-cache and preemption counters), so those figures have
one source of truth: the engine. Used by server/app.py (`/metrics`) and server/serving.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                  5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineStatsCollector(Collector):
    """Reads `stats_provider()` (an EngineStats, or None while the model loads) at scrape time."""

    def __init__(self, stats_provider: Callable[[], Any]):
        self._stats_provider = stats_provider

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_provider()
        if stats is None:
            return
        yield GaugeMetricFamily("tokios:num_requests_running", "Requests in the running batch.",
                                value=stats.num_running)
        yield GaugeMetricFamily("tokios:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=stats.num_waiting)
        yield GaugeMetricFamily("tokios:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                                value=stats.kv_cache_usage)
        yield CounterMetricFamily("tokios:prompt_tokens", "Prompt tokens processed (prefill).",
                                  value=stats.num_prompt_tokens)
        yield CounterMetricFamily("tokios:generation_tokens", "Tokens generated.",
                                  value=stats.num_generation_tokens)
        yield CounterMetricFamily("tokios:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=stats.prefix_cache_queries)
        yield CounterMetricFamily("tokios:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  value=stats.prefix_cache_hits)
        yield CounterMetricFamily("tokios:num_preemptions", "Requests preempted for lack of KV blocks.",
                                  value=stats.num_preemptions)
        yield CounterMetricFamily("tokios:spec_decode_num_drafts", "Speculative verifications with proposed tokens.",
                                  value=stats.spec_num_drafts)
        yield CounterMetricFamily("tokios:spec_decode_num_draft_tokens", "Proposed (draft) tokens verified.",
                                  value=stats.spec_num_draft_tokens)
        yield CounterMetricFamily("tokios:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                                  value=stats.spec_num_accepted_tokens)
        per_position = CounterMetricFamily("tokios:spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens accepted, by position in the draft.", labels=["position"])
        for position, count in enumerate(stats.spec_accepted_per_position or ()):
            per_position.add_metric([str(position)], count)
        yield per_position
        yield CounterMetricFamily("tokios:structured_output_requests", "Requests decoded under a grammar "
                                  "(response_format, structured_outputs, tools).",
                                  value=stats.num_constrained_requests)
        for name, help_text, histogram in (
                ("tokios:grammar_compile_seconds", "Time to compile a grammar (cache misses only).",
                 stats.grammar_compile_seconds),
                ("tokios:grammar_mask_seconds", "Host time per step filling the token masks of its constrained rows.",
                 stats.grammar_mask_seconds)):
            if histogram is not None:
                yield HistogramMetricFamily(name, help_text, buckets=histogram.cumulative(), sum_value=histogram.sum)


class ServerMetrics:
    def __init__(self, stats_provider: Callable[[], Any]):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "tokios:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "tokios:inter_token_latency_seconds", "Time between consecutive generated tokens.",
            buckets=ITL_BUCKETS_S, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "tokios:e2e_request_latency_seconds", "Time from arrival to the last token.",
            buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_queue_time = Histogram(
            "tokios:request_queue_time_seconds", "Time from arrival to first being scheduled.",
            buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_success = Counter(
            "tokios:request_success", "Finished requests by finish reason.", ["finished_reason"],
            registry=self.registry)
        self.http_requests = Counter(
            "tokios:http_requests", "HTTP responses by status code.", ["status"], registry=self.registry)
        self.registry.register(EngineStatsCollector(stats_provider))

    def observe_finished(self, *, ttft_s: float | None, e2e_s: float, queue_s: float | None,
                         finish_reasons: list[str]) -> None:
        """One finished (or aborted) engine request; inter-token latencies are observed as they come."""
        for reason in finish_reasons:
            self.request_success.labels(finished_reason=reason).inc()
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
        if queue_s is not None:
            self.request_queue_time.observe(queue_s)
        self.e2e_request_latency.observe(e2e_s)

    def observe_http_status(self, status: int) -> None:
        self.http_requests.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
