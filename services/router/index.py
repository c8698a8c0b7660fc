"""Router-side view of the Redis block index: lookups, write-back of choices, and the
in-process fallback used while Redis is unreachable.

Normal operation keeps no state in the process: every answer comes from Redis, so replicas
agree. The last heartbeats seen are cached only to route by load while Redis is down, or
restarted empty and the engines have not re-registered yet ("degraded"); requests never fail
because of Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import RedisError

from services.common.redis_index import KVIndexReader
from services.protocol.messages import EngineHeartbeat
from services.protocol.redis_schema import (
    DEFAULT_PENDING_TTL_S,
    DEFAULT_PROVISIONAL_TTL_S,
)
from services.router.discovery import normalize_url
from services.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

REDIS_ERRORS = (RedisError, OSError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class EngineView:
    heartbeat: EngineHeartbeat
    pending: int
    matched_blocks: int
    reach_blocks: int = 0  # through its pool or its host tier (>= matched_blocks)
    shared_blocks: int = 0  # in the model's shared KV store (the same for every engine)


@dataclass(frozen=True, slots=True)
class IndexSnapshot:
    engines: list[EngineView]  # live engines of the model
    dead: list[str]  # registered engine ids whose heartbeat expired
    degraded: bool  # True: Redis unreachable, engines from the fallback cache


class RouterIndex:
    def __init__(
        self,
        reader: KVIndexReader,
        metrics: RouterMetrics,
        *,
        provisional_ttl_s: float = DEFAULT_PROVISIONAL_TTL_S,
        pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
        retry_s: float = 1.0,
        fallback_max_age_s: float = 300.0,
        rejoin_s: float = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._metrics = metrics
        self._provisional_ttl_s = provisional_ttl_s
        self._pending_ttl_s = pending_ttl_s
        self._retry_s = retry_s
        self._max_age_s = fallback_max_age_s
        # How long after the last sighting an empty Redis (restarted) still routes to the
        # engines seen before: they re-register with their next heartbeat.
        self._rejoin_s = rejoin_s
        self._clock = clock
        self._down_until = 0.0
        self._seen: dict[str, dict[str, tuple[EngineHeartbeat, float]]] = {}
        self._local_pending: dict[str, dict[str, int]] = {}
        self._local_counter: dict[str, int] = {}

    @property
    def redis_available(self) -> bool:
        """False while in the back-off window after a Redis error."""
        return self._clock() >= self._down_until

    async def lookup(self, model: str, block_hashes: Sequence[bytes], *,
                     timed: bool = True) -> IndexSnapshot:
        """The model's live engines and what each holds of the prompt; ``timed``: observed in
        the lookup-time histogram (routing lookups, not the metrics scrape's)."""
        if self.redis_available:
            start = time.perf_counter()
            try:
                result = await self._reader.lookup(model, block_hashes)
            except REDIS_ERRORS as exc:
                self.redis_failed("lookup", exc)
            else:
                if timed:
                    self._metrics.lookup_seconds.observe(time.perf_counter() - start)
                if not result.engines and not result.dead and self._recently_seen(model):
                    # Redis answers but knows no engine of the model, not even a dead one:
                    # it restarted (or was flushed) and the engines have not heartbeated yet.
                    return IndexSnapshot(self._fallback(model), [], degraded=True)
                self._remember(model, [m.heartbeat for m in result.engines])
                views = [
                    EngineView(m.heartbeat, m.pending, m.matched_blocks, m.reach_blocks,
                               result.shared_blocks)
                    for m in result.engines
                ]
                return IndexSnapshot(views, result.dead, degraded=False)
        return IndexSnapshot(self._fallback(model), [], degraded=True)

    async def record_choice(
        self,
        model: str,
        engine_id: str,
        block_hashes: Sequence[bytes],
        snapshot: IndexSnapshot,
    ) -> None:
        """Writes the choice back at once: the engine provisionally holds the prompt's blocks
        (so sibling requests follow it) and one more request is pending on it."""
        if not snapshot.degraded and self.redis_available:
            try:
                await self._reader.mark(
                    model,
                    engine_id,
                    block_hashes,
                    ttl_s=self._provisional_ttl_s,
                    pending_ttl_s=self._pending_ttl_s,
                    forget=snapshot.dead,
                )
                return
            except REDIS_ERRORS as exc:
                self.redis_failed("mark", exc)
        pending = self._local_pending.setdefault(model, {})
        pending[engine_id] = pending.get(engine_id, 0) + 1

    async def next_counter(self, model: str) -> int:
        if self.redis_available:
            try:
                return await self._reader.next_counter(model)
            except REDIS_ERRORS as exc:
                self.redis_failed("counter", exc)
        self._local_counter[model] = self._local_counter.get(model, 0) + 1
        return self._local_counter[model]

    async def models(self) -> list[str] | None:
        """Models with registered engines, or None when Redis is unreachable."""
        if self.redis_available:
            try:
                return await self._reader.models()
            except REDIS_ERRORS as exc:
                self.redis_failed("models", exc)
        return None

    async def ping(self) -> bool:
        try:
            ok = await self._reader.ping()
        except REDIS_ERRORS as exc:
            self.redis_failed("ping", exc)
            return False
        self._down_until = 0.0
        return ok

    def cached_models(self) -> list[str]:
        return sorted(self._seen)

    def heartbeats(self, model: str) -> list[EngineHeartbeat]:
        """The model's heartbeats as the last lookup saw them (no Redis call)."""
        return [hb for hb, _ in self._seen.get(model, {}).values()]

    def local_pending(self, model: str) -> dict[str, int]:
        """Requests routed per engine while degraded (reset when Redis answers again)."""
        return dict(self._local_pending.get(model, {}))

    def engines_of_other_models(self, model: str) -> set[str]:
        """Engine ids and normalized URLs last seen serving a model other than ``model``."""
        out: set[str] = set()
        for other, engines in self._seen.items():
            if other != model:
                for engine_id, (hb, _) in engines.items():
                    out.add(engine_id)
                    out.add(normalize_url(hb.url))
        return out

    def redis_failed(self, op: str, exc: BaseException) -> None:
        """Counts the error and routes without Redis for ``retry_s`` (the other router parts
        that use Redis report their errors here too, so all of them back off together)."""
        self._metrics.redis_errors.labels(op=op).inc()
        if self.redis_available:
            logger.warning("redis unavailable op=%s error=%s: %s; routing by last known load",
                           op, type(exc).__name__, exc)
        self._down_until = self._clock() + self._retry_s

    def _remember(self, model: str, heartbeats: list[EngineHeartbeat]) -> None:
        self._local_pending.pop(model, None)
        if not heartbeats:  # unknown model names must not grow the cache
            self._seen.pop(model, None)
            return
        now = self._clock()
        self._seen[model] = {hb.engine_id: (hb, now) for hb in heartbeats}

    def _recently_seen(self, model: str) -> bool:
        """Whether live engines of ``model`` were seen within the rejoin window."""
        newest = max((seen for _, seen in self._seen.get(model, {}).values()), default=None)
        return newest is not None and self._clock() - newest <= self._rejoin_s

    def _fallback(self, model: str) -> list[EngineView]:
        oldest = self._clock() - self._max_age_s
        pending = self._local_pending.get(model, {})
        return [
            EngineView(hb, pending.get(engine_id, 0), 0)
            for engine_id, (hb, seen) in sorted(self._seen.get(model, {}).items())
            if seen >= oldest
        ]
