"""Prometheus metrics of one gateway process.

Owns a private registry (so two gateways in one process, as in tests, do not collide) and the
metric names; the gateway app updates them and serves `render()` at /metrics.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tokios_gateway_requests",
            "Client requests by backend and outcome (HTTP status, or stream_error / client_closed).",
            ["backend", "status"],
            registry=self.registry,
        )
        self.request_latency = Histogram(
            "tokios_gateway_request_latency_seconds",
            "Time from request arrival to the last byte sent to the client.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "tokios_gateway_time_to_first_byte_seconds",
            "Time from request arrival to the first body byte from the backend.",
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.connected_backends = Gauge(
            "tokios_gateway_connected_backends", "Connectors currently registered.", registry=self.registry
        )
        self.in_flight = Gauge(
            "tokios_gateway_in_flight_requests", "Client requests being served now.", registry=self.registry
        )
        self.retries = Counter(
            "tokios_gateway_retries", "Attempts moved to another backend before the first byte.", registry=self.registry
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
