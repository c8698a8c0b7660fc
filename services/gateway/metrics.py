"""Prometheus metrics of the gateway, in a registry of its own (one per app, so tests can run
several apps in one process).

The ``model`` label only ever takes configured model names (or ``"other"``), so clients cannot
blow up label cardinality with made-up names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.process_metrics import register_process_metrics

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)
OTHER_MODEL = "other"


@dataclass(slots=True)
class GatewayMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    requests: Counter = field(init=False)
    in_flight: Gauge = field(init=False)
    ttft: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    engine_retries: Counter = field(init=False)
    stream_errors: Counter = field(init=False)
    waiting_for_engine: Gauge = field(init=False)
    engine_wait_refused: Counter = field(init=False)
    pd_legs: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        register_process_metrics(r)
        self.requests = Counter(
            "pagoda_gateway_requests",
            "Finished HTTP requests by endpoint, model and status.",
            ["endpoint", "model", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pagoda_gateway_requests_in_flight",
            "Generation requests being served now.",
            ["endpoint", "model"],
            registry=r,
        )
        self.ttft = Histogram(
            "pagoda_gateway_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagoda_gateway_e2e_request_latency_seconds",
            "From request arrival to the last byte of a successful generation.",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_retries = Counter(
            "pagoda_gateway_engine_retries",
            "Engines that failed before the first token and were replaced by another.",
            ["model"],
            registry=r,
        )
        self.pd_legs = Counter(
            "pagoda_gateway_pd_prefill_decisions",
            "P/D: prompts sent through a prefill leg (prefill) or straight to a decode engine, "
            "as short (short) or with enough of their prefix cached there or on a peer "
            "(cached): selective P/D's threshold counts the uncached part.",
            ["model", "decision"],
            registry=r,
        )
        self.stream_errors = Counter(
            "pagoda_gateway_stream_errors",
            "Generations that failed after their first token (ended with an error event).",
            ["model"],
            registry=r,
        )

        self.waiting_for_engine = Gauge(
            "pagoda_gateway_requests_waiting_for_engine",
            "Engine requests held because their model has no ready engine (scale from zero).",
            ["model"],
            registry=r,
        )
        self.engine_wait_refused = Counter(
            "pagoda_gateway_engine_wait_refused",
            "Requests refused for want of an engine: 429 (too many held), 503 (held too long).",
            ["model", "status"],
            registry=r,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
