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
    """Reads `stats_provider()` ((model name, EngineStats) for every loaded model) at scrape time;
    every family is labelled by model_name (vLLM's label)."""

    def __init__(self, stats_provider: Callable[[], list[tuple[str, Any]]]):
        self._stats_provider = stats_provider

    def collect(self) -> Iterator[Metric]:
        model_stats = self._stats_provider()
        if not model_stats:
            return
        labels = ["model_name"]
        for kind, name, help_text, attribute in _ENGINE_FAMILIES:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, help_text, labels=labels)
            for model_name, stats in model_stats:
                family.add_metric([model_name], getattr(stats, attribute))
            yield family
        per_position = CounterMetricFamily("tokios:spec_decode_num_accepted_tokens_per_pos",
                                           "Proposed tokens accepted, by position in the draft.",
                                           labels=["model_name", "position"])
        for model_name, stats in model_stats:
            for position, count in enumerate(stats.spec_accepted_per_position or ()):
                per_position.add_metric([model_name, str(position)], count)
        yield per_position
        for name, help_text, attribute in (
                ("tokios:grammar_compile_seconds", "Time to compile a grammar (cache misses only).",
                 "grammar_compile_seconds"),
                ("tokios:grammar_mask_seconds", "Host time per step filling the token masks of its constrained rows.",
                 "grammar_mask_seconds")):
            family = HistogramMetricFamily(name, help_text, labels=labels)
            for model_name, stats in model_stats:
                histogram = getattr(stats, attribute)
                if histogram is not None:
                    family.add_metric([model_name], buckets=histogram.cumulative(), sum_value=histogram.sum)
            yield family


# (kind, name, help, EngineStats attribute) of the per-model engine figures.
_ENGINE_FAMILIES = (
    ("gauge", "tokios:num_requests_running", "Requests in the running batch.", "num_running"),
    ("gauge", "tokios:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("gauge", "tokios:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", "kv_cache_usage"),
    ("counter", "tokios:prompt_tokens", "Prompt tokens processed (prefill).", "num_prompt_tokens"),
    ("counter", "tokios:generation_tokens", "Tokens generated.", "num_generation_tokens"),
    ("counter", "tokios:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("counter", "tokios:prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("counter", "tokios:prefix_cache_disk_hits", "Prompt tokens loaded from the prefix cache's disk tier.",
     "disk_cache_hit_tokens"),
    ("counter", "tokios:prefix_cache_disk_rejected", "Disk tier files ignored as corrupt, truncated or foreign.",
     "disk_cache_rejected"),
    ("gauge", "tokios:prefix_cache_disk_bytes", "Bytes the prefix cache's disk tier holds.", "disk_cache_bytes"),
    ("counter", "tokios:num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
    ("counter", "tokios:weight_bytes_read", "Weight bytes the quantized kernels read (a mixture of experts: the "
     "chosen experts' only; 0 where weights run off the kernels).", "weight_bytes_read"),
    ("counter", "tokios:spec_decode_num_drafts", "Speculative verifications with proposed tokens.", "spec_num_drafts"),
    ("counter", "tokios:spec_decode_num_draft_tokens", "Proposed (draft) tokens verified.", "spec_num_draft_tokens"),
    ("counter", "tokios:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", "spec_num_accepted_tokens"),
    ("counter", "tokios:structured_output_requests",
     "Requests decoded under a grammar (response_format, structured_outputs, tools).", "num_constrained_requests"),
)


class ServerMetrics:
    def __init__(self, stats_provider: Callable[[], list[tuple[str, Any]]]):
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "tokios:time_to_first_token_seconds", "Time from arrival to the first generated token.",
            ["model_name"], buckets=TTFT_BUCKETS_S, registry=self.registry)
        self.inter_token_latency = Histogram(
            "tokios:inter_token_latency_seconds", "Time between consecutive generated tokens.",
            ["model_name"], buckets=ITL_BUCKETS_S, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "tokios:e2e_request_latency_seconds", "Time from arrival to the last token.",
            ["model_name"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_queue_time = Histogram(
            "tokios:request_queue_time_seconds", "Time from arrival to first being scheduled.",
            ["model_name"], buckets=E2E_BUCKETS_S, registry=self.registry)
        self.request_success = Counter(
            "tokios:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry)
        self.http_requests = Counter(
            "tokios:http_requests", "HTTP responses by status code.", ["status"], registry=self.registry)
        self.registry.register(EngineStatsCollector(stats_provider))

    def add_model(self, model_name: str) -> None:
        """Starts a model's latency series at zero (a series that appears only once observed looks
        like a missing metric to dashboards and alerts)."""
        for histogram in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                          self.request_queue_time):
            histogram.labels(model_name=model_name)

    def observe_finished(self, model_name: str, *, ttft_s: float | None, e2e_s: float, queue_s: float | None,
                         finish_reasons: list[str]) -> None:
        """One finished (or aborted) engine request; inter-token latencies are observed as they come."""
        for reason in finish_reasons:
            self.request_success.labels(model_name=model_name, finished_reason=reason).inc()
        if ttft_s is not None:
            self.time_to_first_token.labels(model_name=model_name).observe(ttft_s)
        if queue_s is not None:
            self.request_queue_time.labels(model_name=model_name).observe(queue_s)
        self.e2e_request_latency.labels(model_name=model_name).observe(e2e_s)

    def observe_inter_token(self, model_name: str, gap_s: float, num_tokens: int) -> None:
        histogram = self.inter_token_latency.labels(model_name=model_name)
        for _ in range(num_tokens):
            histogram.observe(gap_s)

    def observe_http_status(self, status: int) -> None:
        self.http_requests.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
