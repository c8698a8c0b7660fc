"""Per-model demand, as the router sees it first: what autoscalers (KEDA) scale the engines on.

Exported on ``/metrics`` with the label ``model`` (the served model name)::

    pagoda_router_requests_waiting    requests waiting for an engine: held at gateways (no
                                      ready engine) + routed but not yet in the engine's
                                      heartbeat + queued at the engines
    pagoda_router_requests_running    requests the engines run
    pagoda_router_requests_in_flight  waiting + running
    pagoda_router_requests_held       the part of waiting held at gateways
    pagoda_router_arrivals_total      requests that asked for an engine (counter; one per
                                      engine request, i.e. per choice, at its first ask)
    pagoda_router_arrival_rate        arrivals per second over the last minute
    pagoda_router_prompt_tokens_total prompt tokens of those arrivals (counter), by P/D leg
                                      (label ``role``: prefill, decode, any): the prefill
                                      engines' demand

The first four are fleet-wide and the same on every router replica: they are computed when
``/metrics`` is scraped, from Redis (the engines' heartbeats, the routers' pending counts and
the held set), so aggregate them across replicas with ``max()``. The last three are this
replica's own (every request's first ask reaches exactly one replica): aggregate with
``sum()``. The arrival rate is a gauge, not only a counter, because a model waking from zero
must show at its very first request: a counter series born with the value 1 has no ``rate()``.

Held requests. A gateway with no ready engine for a model holds the request and asks again
every ``ENGINE_WAIT_POLL_S`` with ``waited_s`` > 0. Each ask that finds no engine puts the
request id in the model's held set (Redis ZSET, score = when it stops counting: a few poll
intervals on), and a held request that gets an engine leaves it. A gateway that gives up simply
stops asking, and the entry lapses. So every replica counts the same held requests, and no
state lives in the process except the arrival counts.

Redis being down never fails a route: held-set writes are skipped (and back off with the
index), and the gauges keep their last values (running and waiting come from the index's
fallback, the last heartbeats seen).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as aioredis

from services.protocol.messages import ENGINE_WAIT_POLL_S, RouteRequest
from services.protocol.redis_schema import RedisKeys
from services.router.index import REDIS_ERRORS, RouterIndex
from services.router.metrics import RouterMetrics
from services.router.policies import Candidate

logger = logging.getLogger(__name__)

HELD_TTL_S = 4 * ENGINE_WAIT_POLL_S  # a held request counts this long after its last ask
ARRIVAL_WINDOW_S = 60.0
MAX_MODELS = 256  # model labels; the gateways send only the models they serve
_HELD_KEY_TTL_MS = 60_000  # the held set itself, after its last write


class ArrivalRate:
    """Arrivals per second over a sliding window, in one-second buckets."""

    def __init__(self, window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.window_s = window_s
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first

    def add(self, now: float) -> None:
        second = int(now)
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += 1
        else:
            self._buckets.append([second, 1])
        self._trim(now)

    def per_second(self, now: float) -> float:
        self._trim(now)
        return sum(count for _, count in self._buckets) / self.window_s

    def _trim(self, now: float) -> None:
        oldest = now - self.window_s
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()


class Demand:
    """A route observer (``Router.observers``) and the demand gauges' source."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: RedisKeys,
        index: RouterIndex,
        metrics: RouterMetrics,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._keys = keys
        self._index = index
        self._metrics = metrics
        self._clock = clock
        self._rates: dict[str, ArrivalRate] = {}
        self._models: set[str] = set()  # models with exported series
        self._held: dict[str, int] = {}  # last held count read, per model

    # -- route observer ------------------------------------------------------------------------

    async def observe(self, req: RouteRequest, chosen: Candidate | None) -> None:
        """One ``/route`` answer: ``chosen`` is None when no engine of the model is live."""
        if not self._known(req.model):
            return
        if req.waited_s == 0 and not req.exclude:
            self._metrics.arrivals.labels(model=req.model).inc()
            self._metrics.prompt_tokens.labels(model=req.model, role=req.role or "any").inc(
                req.prompt_len)
            self._rates[req.model].add(self._clock())
        if req.request_id is None:
            return
        if chosen is None:
            await self._held_write(req.model, req.request_id, hold=True)
        elif req.waited_s > 0:
            await self._held_write(req.model, req.request_id, hold=False)

    def _known(self, model: str) -> bool:
        if model not in self._models:
            if len(self._models) >= MAX_MODELS:
                logger.warning("demand metrics: more than %d models; ignoring model=%s",
                               MAX_MODELS, model)
                return False
            self._models.add(model)
            self._rates[model] = ArrivalRate()
        return True

    async def _held_write(self, model: str, request_id: str, *, hold: bool) -> None:
        if not self._index.redis_available:
            return
        key = self._keys.held(model)
        try:
            if hold:
                until_ms = int((self._clock() + HELD_TTL_S) * 1000)
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.zadd(key, {request_id: until_ms})
                    pipe.pexpire(key, _HELD_KEY_TTL_MS)
                    await pipe.execute()
            else:
                await self._redis.zrem(key, request_id)
        except REDIS_ERRORS as exc:
            self._index.redis_failed("held", exc)

    # -- gauges --------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Sets the gauges from Redis now (called by ``GET /metrics``)."""
        models = await self._index.models()
        for model in models if models is not None else self._index.cached_models():
            self._known(model)
        now = self._clock()
        for model in sorted(self._models):
            snapshot = await self._index.lookup(model, (), timed=False)
            running = sum(v.heartbeat.running for v in snapshot.engines)
            queued = sum(v.heartbeat.waiting + v.pending for v in snapshot.engines)
            held = await self._held_count(model, now)
            if held is None:  # Redis unreachable: the last value stands
                held = self._held.get(model, 0)
            self._held[model] = held
            m = self._metrics
            m.requests_held.labels(model=model).set(held)
            m.requests_running.labels(model=model).set(running)
            m.requests_waiting.labels(model=model).set(held + queued)
            m.requests_in_flight.labels(model=model).set(held + queued + running)
            m.arrival_rate.labels(model=model).set(self._rates[model].per_second(now))

    async def _held_count(self, model: str, now: float) -> int | None:
        if not self._index.redis_available:
            return None
        key = self._keys.held(model)
        now_ms = int(now * 1000)
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.zremrangebyscore(key, "-inf", now_ms)
                pipe.zcard(key)
                _, count = await pipe.execute()
        except REDIS_ERRORS as exc:
            self._index.redis_failed("held", exc)
            return None
        return int(count)
