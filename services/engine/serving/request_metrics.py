"""vLLM's per-request and per-step metric families, with vLLM's names, types, labels
(``model_name``, ``engine``) and buckets, fed from each finished request's update and from
each engine step.

Each sample of an ``n > 1`` request is its own engine request here (the gateway fans out
``n``), so ``vllm:request_params_n`` observes 1 per engine request, and
``vllm:request_max_num_generation_tokens`` (vLLM: the most tokens any of a request's ``n``
samples generated) observes that request's own generated tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's request_latency_buckets (seconds) and its per-step token buckets.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
# vLLM's inter-token latency buckets (seconds), also those of the per-request mean (TPOT).
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's: the first holds 0 and 1 preemption
ENGINE_INDEX = "0"  # one engine core per process (vLLM labels data-parallel cores 0, 1, ...)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class RequestMetrics:
    """Registers the families on ``registry``; ``max_model_len`` sets the token buckets."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        labels = ["model_name", "engine"]
        self._labels = (model_name, ENGINE_INDEX)
        r = registry
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.queue = hist("vllm:request_queue_time_seconds",
                          "Histogram of time spent in WAITING phase for request.",
                          REQUEST_LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds",
                            "Histogram of time spent in PREFILL phase for request.",
                            REQUEST_LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds",
                           "Histogram of time spent in DECODE phase for request.",
                           REQUEST_LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds",
                              "Histogram of time spent in RUNNING phase for request.",
                              REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = hist("vllm:request_prompt_tokens",
                                  "Number of prefill tokens processed.", tokens)
        self.generation_tokens = hist("vllm:request_generation_tokens",
                                      "Number of generation tokens processed.", tokens)
        self.params_n = hist("vllm:request_params_n", "Histogram of the n request parameter.",
                             N_BUCKETS)
        self.params_max_tokens = hist("vllm:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", tokens)
        self.max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.time_per_output_token = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self.num_preemptions = hist("vllm:request_num_preemptions",
                                    "Histogram of the number of preemptions per request.",
                                    PREEMPTION_BUCKETS)
        self.prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens)
        self.iteration_tokens = hist("vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.cached_tokens = Counter("vllm:prompt_tokens_cached",
                                     "Number of cached prompt tokens (local prefix cache).",
                                     labels, registry=r)
        # Each family's one series, bound once (as vLLM does, so they read 0 from the start): a
        # ``labels()`` lookup per family per finished request was a few % of the serving loop
        # at 256 streams.
        lv = self._labels
        self._queue, self._prefill = self.queue.labels(*lv), self.prefill.labels(*lv)
        self._decode, self._inference = self.decode.labels(*lv), self.inference.labels(*lv)
        self._prompt_tokens = self.prompt_tokens.labels(*lv)
        self._generation_tokens = self.generation_tokens.labels(*lv)
        self._tpot = self.time_per_output_token.labels(*lv)
        self._max_generation_tokens = self.max_generation_tokens.labels(*lv)
        self._num_preemptions = self.num_preemptions.labels(*lv)
        self._prefill_kv_computed = self.prefill_kv_computed.labels(*lv)
        self._params_n = self.params_n.labels(*lv)
        self._params_max_tokens = self.params_max_tokens.labels(*lv)
        self._cached_tokens = self.cached_tokens.labels(*lv)
        self._iteration_tokens = self.iteration_tokens.labels(*lv)

    def observe_finished(
        self,
        *,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        prompt_tokens: int,
        output_tokens: int,
        cached_tokens: int,
        max_tokens: int,
        num_preemptions: int = 0,
        now: float | None = None,
    ) -> None:
        """One finished engine request; times are ``time.monotonic()`` seconds."""
        now = time.monotonic() if now is None else now
        scheduled = first_scheduled if first_scheduled is not None else now
        first = first_token if first_token is not None else now
        self._queue.observe(max(scheduled - arrival, 0.0))
        self._prefill.observe(max(first - scheduled, 0.0))
        decode = max(now - first, 0.0)
        self._decode.observe(decode)
        self._inference.observe(max(now - scheduled, 0.0))
        self._prompt_tokens.observe(prompt_tokens)
        self._generation_tokens.observe(output_tokens)
        # As vLLM: the first token is the prefill's, so the mean is over the ones after it.
        tpot = decode / (output_tokens - 1) if output_tokens > 1 else 0.0
        self._tpot.observe(tpot)
        self._max_generation_tokens.observe(output_tokens)
        self._num_preemptions.observe(num_preemptions)
        self._prefill_kv_computed.observe(prompt_tokens - max(cached_tokens, 0))
        self._params_n.observe(1)
        if max_tokens:
            self._params_max_tokens.observe(max_tokens)
        self._cached_tokens.inc(cached_tokens)

    def observe_step(self, num_tokens: int) -> None:
        """Tokens one engine step computed (prefill chunks and decodes together)."""
        self._iteration_tokens.observe(num_tokens)


class WaitingAndCacheCollector(Collector):
    """``vllm:num_requests_waiting_by_reason`` (every waiting request waits for capacity here:
    nothing is deferred) and ``vllm:cache_config_info``, read at scrape time."""

    def __init__(
        self,
        model_name: str,
        num_waiting: Callable[[], int | None],
        cache_info: Callable[[], dict[str, str] | None],
    ) -> None:
        self._model = model_name
        self._num_waiting = num_waiting
        self._cache_info = cache_info

    def collect(self) -> Iterator:
        waiting = self._num_waiting()
        if waiting is not None:
            g = GaugeMetricFamily("vllm:num_requests_waiting_by_reason",
                                  "Number of requests waiting, by the reason they wait.",
                                  labels=["model_name", "engine", "reason"])
            g.add_metric([self._model, ENGINE_INDEX, "capacity"], waiting)
            g.add_metric([self._model, ENGINE_INDEX, "deferred"], 0)
            yield g
        info = self._cache_info()
        if info is not None:
            labels = {**info, "engine": ENGINE_INDEX}
            g = GaugeMetricFamily("vllm:cache_config_info",
                                  "Information of the LLMEngine CacheConfig",
                                  labels=sorted(labels))
            g.add_metric([labels[k] for k in sorted(labels)], 1)
            yield g
