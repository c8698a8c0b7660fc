"""Prometheus metrics of one router app (own registry, so several apps can share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.process_metrics import register_process_metrics

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
_LOOKUP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        register_process_metrics(r)
        self.decisions = Counter(
            "pagoda_router_decisions",
            "Routing decisions by policy and reason",
            ["policy", "reason"],
            registry=r,
        )
        self.matched_ratio = Histogram(
            "pagoda_router_matched_block_ratio",
            "Leading blocks the chosen engine holds / blocks in the prompt",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.lookup_seconds = Histogram(
            "pagoda_router_lookup_seconds",
            "Time of the Redis block-index lookup (one round trip)",
            buckets=_LOOKUP_BUCKETS,
            registry=r,
        )
        self.redis_errors = Counter(
            "pagoda_router_redis_errors", "Redis calls that failed", ["op"], registry=r
        )
        self.no_engine = Counter(
            "pagoda_router_no_engine",
            "Requests answered with no engine (503: none live, 409: all excluded)",
            ["status"],
            registry=r,
        )
        self.live_engines = Gauge(
            "pagoda_router_live_engines",
            "Engines discovered and with a live heartbeat, per model",
            ["model"],
            registry=r,
        )
        self.discovery_restarts = Counter(
            "pagoda_router_discovery_restarts",
            "Kubernetes watch restarts after an error",
            registry=r,
        )
        # Demand (services/router/demand.py): what the engines' autoscaler reads.
        self.requests_waiting = Gauge(
            "pagoda_router_requests_waiting",
            "Requests waiting for an engine: held at gateways + routed, not yet reported by "
            "the engine + queued at engines (fleet-wide: max() across router replicas)",
            ["model"],
            registry=r,
        )
        self.requests_running = Gauge(
            "pagoda_router_requests_running",
            "Requests running at the engines (fleet-wide: max() across router replicas)",
            ["model"],
            registry=r,
        )
        self.requests_in_flight = Gauge(
            "pagoda_router_requests_in_flight",
            "Requests waiting + running (fleet-wide: max() across router replicas)",
            ["model"],
            registry=r,
        )
        self.requests_held = Gauge(
            "pagoda_router_requests_held",
            "Requests held at gateways for want of a ready engine (fleet-wide)",
            ["model"],
            registry=r,
        )
        self.arrivals = Counter(
            "pagoda_router_arrivals",
            "Engine requests that asked this replica for an engine (first asks only)",
            ["model"],
            registry=r,
        )
        self.arrival_rate = Gauge(
            "pagoda_router_arrival_rate",
            "Arrivals per second at this replica over the last minute (sum() across replicas)",
            ["model"],
            registry=r,
        )
        # P/D autoscaling: prefill engines scale on the prompt tokens coming to them.
        self.prompt_tokens = Counter(
            "pagoda_router_prompt_tokens",
            "Prompt tokens of the engine requests routed by this replica (first asks only), by "
            "P/D leg: prefill, decode, or any (aggregated)",
            ["model", "role"],
            registry=r,
        )
