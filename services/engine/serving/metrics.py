"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers work. The
features' server parts add their own families (``ServerPart.metric_families``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.common.process_metrics import register_process_metrics
from services.engine.engine import EngineStats
from services.engine.features import server_parts
from services.engine.kv_connector import transfer_stats
from services.engine.kv_connector.transfer_stats import DIRECTIONS, TransferStats
from services.engine.kv_offload.tiers import KVTierStats
from services.engine.serving.request_metrics import (
    ENGINE_INDEX,
    RequestMetrics,
    WaitingAndCacheCollector,
)
from services.engine.spec_decode.metrics import metric_families

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _StatsCollector(Collector):
    """Reads the engine's latest stats snapshot at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self._model = model_name
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:
            return
        labels = ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", s.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", s.kv_usage),
            ("pagoda:kv_free_blocks", "Free KV blocks (cached ones included).", s.num_free_blocks),
            ("pagoda:kv_total_blocks", "KV blocks in the cache.", s.num_total_blocks),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric([self._model], value)
            yield g
        for name, doc, value in (
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache.",
             s.prefix_cache_hits),
            ("vllm:num_preemptions", "Preemptions by recompute.", s.num_preemptions),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric([self._model], value)
            yield c
        for part in server_parts.parts():
            yield from part.metric_families(self._model, ENGINE_INDEX, s)
        if s.spec_decode is not None:
            yield from metric_families(self._model, ENGINE_INDEX, s.spec_decode)
        if s.kv_tiers is not None:
            yield from _kv_tiers(self._model, s.kv_tiers)
        if s.kv_transfer is not None:
            yield from _kv_transfer(self._model, s.kv_transfer)


def _histogram(family: HistogramMetricFamily, labels: list[str],
               h: transfer_stats.Histogram) -> None:
    running, buckets = 0, []
    for bound, count in zip([*map(str, h.buckets), "+Inf"], h.counts, strict=True):
        running += count
        buckets.append((bound, running))
    family.add_metric(labels, buckets, h.total)


def _kv_transfer(model: str, t: TransferStats) -> Iterator:
    """KV moved between engines, on both ends: Pagoda's names by direction, and vLLM's NIXL
    connector's names (its transfers are the puller's: ``received``) for dashboards built on
    them."""
    labels = ["model_name", "direction"]
    c = CounterMetricFamily("pagoda:kv_transfer_bytes", "KV bytes moved between engines.",
                            labels=labels)
    seconds = HistogramMetricFamily("pagoda:kv_transfer_seconds",
                                    "Duration of KV transfers between engines.", labels=labels)
    for direction in DIRECTIONS:
        d = getattr(t, direction)
        c.add_metric([model, direction], d.bytes)
        _histogram(seconds, [model, direction], d.seconds)
    yield c
    yield seconds
    failures = CounterMetricFamily("pagoda:kv_transfer_failures",
                                   "KV transfers that failed (recomputed), by reason.",
                                   labels=["model_name", "reason"])
    for reason, count in sorted(t.failures.items()):
        failures.add_metric([model, reason], count)
    yield failures
    engine = ["model_name", "engine"]
    for name, doc, h in (
        ("vllm:nixl_xfer_time_seconds", "Histogram of transfer duration for KV cache "
         "transfers (pulled).", t.received.seconds),
        ("vllm:nixl_bytes_transferred", "Histogram of bytes transferred per KV cache "
         "transfer (pulled).", t.received.sizes),
    ):
        family = HistogramMetricFamily(name, doc, labels=engine)
        _histogram(family, [model, ENGINE_INDEX], h)
        yield family
    for name, doc, value in (
        ("vllm:nixl_num_failed_transfers", "Number of failed KV cache transfers.",
         sum(t.failures.values())),
        ("vllm:nixl_num_kv_expired_reqs", "Number of requests that had their KV expire "
         "(held for a pull that never came; prefill side).", t.expired),
    ):
        c = CounterMetricFamily(name, doc, labels=engine)
        c.add_metric([model, ENGINE_INDEX], value)
        yield c


def _kv_tiers(model: str, t: KVTierStats) -> Iterator:
    """vLLM's external-prefix-cache and prompt-token-source counters, and the tiers' own."""
    labels = ["model_name"]
    for name, doc, value in (
        ("vllm:external_prefix_cache_queries",
         "External prefix cache queries (host memory, shared store), in queried tokens.",
         t.external_queries),
        ("vllm:external_prefix_cache_hits",
         "External prefix cache hits (host memory, shared store), in cached tokens.",
         t.external_hits),
        ("pagoda:kv_store_errors", "Shared KV store calls that failed or timed out (the "
         "blocks were recomputed).", 0 if t.store is None else t.store.errors),
        ("pagoda:kv_store_corrupt_blocks", "Shared KV store blocks that failed their MAC "
         "check (foreign, damaged or another block's; recomputed).",
         0 if t.store is None else t.store.corrupt),
        ("pagoda:kv_store_dropped_writes", "Blocks not written to the shared KV store "
         "(store down, or its write queue full).", 0 if t.store is None else
         t.store.dropped_writes),
    ):
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric([model], value)
        yield c
    c = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                            labels=[*labels, "source"])
    for source, value in (("local_compute", t.local_compute),
                          ("local_cache_hit", t.local_cache_hit),
                          ("external_kv_transfer", t.external_kv_transfer)):
        c.add_metric([model, source], value)
    yield c
    c = CounterMetricFamily("vllm:prompt_tokens_cached_by_source",
                            "Prefix-cache hit tokens by the tier that supplied them.",
                            labels=[*labels, "source"])
    c.add_metric([model, "device"], t.local_cache_hit)
    c.add_metric([model, "host"], t.host_hit_tokens)
    c.add_metric([model, "external_unspecified"], t.shared_hit_tokens)
    yield c
    for name, doc, value in (
        ("pagoda:kv_host_blocks", "KV blocks held in host memory.", t.host_blocks),
        ("pagoda:kv_host_capacity_blocks", "KV blocks host memory can hold.", t.host_capacity),
        ("pagoda:kv_store_available", "1 while the shared KV store answers.",
         int(t.store_available)),
    ):
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric([model], value)
        yield g


class EngineMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        cache_info: Callable[[], dict[str, str] | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        # vLLM's request histograms size their token buckets by max_model_len, known once the
        # engine has loaded: made then, by whichever thread gets there first.
        self._requests: RequestMetrics | None = None
        self._requests_lock = threading.Lock()
        labels = ["model_name"]
        r = self.registry
        register_process_metrics(r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=r)
        r.register(_StatsCollector(model_name, stats))

        def waiting() -> int | None:
            s = stats()
            return None if s is None else s.num_waiting

        r.register(WaitingAndCacheCollector(model_name, waiting, cache_info))

    def requests(self, max_model_len: int) -> RequestMetrics:
        if self._requests is None:
            with self._requests_lock:
                if self._requests is None:
                    self._requests = RequestMetrics(self.registry, self.model_name, max_model_len)
        return self._requests

    def observe_finished(self, prompt_tokens: int, output_tokens: int, reason: str) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.request_success.labels(m, reason or "unknown").inc()
