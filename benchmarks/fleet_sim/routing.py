"""How the simulation picks engines: the real router on a real Redis, or an exact oracle.

``RedisRouting`` is the production path minus HTTP: ``services.router.routing.Router`` with
its ``RouterIndex`` and ``KVIndexReader`` (the Lua lookup and write-back), the policy from
``make_policy``, and the engines' state arriving only through ``KVIndexPublisher`` (KV events
and heartbeats, published on each engine's own tick, as ``services.engine.serving.redis_publisher``
does). Between ticks the router sees what a real router sees: stale heartbeats plus its own
pending counts and provisional write-backs.

``OracleRouting`` runs the same ``PrefixPolicy`` code on exact, current state: every engine's
prefix cache as its block manager holds it this instant, and its true queue lengths.

Shortcut for the load-only policies (``least-loaded``, ``round-robin``): they never read the
block index, so the simulation neither sends them the prompt's hashes nor publishes KV events
for them. Their decisions are exactly what they would be with both (the lookup still returns
every live engine's heartbeat and pending count, and the write-back still counts the request
as pending), at a fraction of the Redis work, which keeps 128-engine runs short.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Protocol

from benchmarks.fleet_sim.engine import SimEngine, SimRequest
from benchmarks.fleet_sim.trace import MODEL
from services.common.redis_index import KVIndexPublisher, KVIndexReader, connect
from services.protocol.messages import EngineHeartbeat, RouteRequest
from services.protocol.redis_schema import RedisKeys
from services.router.config import PolicyName, RouterConfig
from services.router.discovery import OpenDiscovery
from services.router.index import RouterIndex
from services.router.metrics import RouterMetrics
from services.router.policies import Candidate, PolicyContext, make_policy
from services.router.routing import Router

ORACLE = "oracle"
# Simulated time runs faster or slower than Redis's clock; TTLs (Redis time) are set far past
# any run so that nothing expires mid-run. A heartbeat still resets the pending count.
_LONG_TTL_S = 3600.0


class Routing(Protocol):
    name: str
    reasons: Counter[str]

    async def start(self, engines: list[SimEngine]) -> None: ...

    async def route(self, req: SimRequest, engines: dict[str, SimEngine]) -> str: ...

    async def publish(self, engine: SimEngine, now: float) -> None: ...

    async def close(self) -> None: ...


def heartbeat(engine: SimEngine, now: float) -> EngineHeartbeat:
    bm = engine.bm
    return EngineHeartbeat(
        engine_id=engine.engine_id,
        url=engine.url,
        model=MODEL,
        block_size=engine.spec.block_size,
        running=engine.num_running,
        waiting=engine.num_waiting,
        kv_usage=min(max(bm.usage, 0.0), 1.0),
        free_blocks=bm.num_free_blocks,
        total_blocks=bm.num_total_blocks,
        timestamp=now,
    )


class RedisRouting:
    def __init__(
        self, redis_url: str, policy: str, namespace: str, config: RouterConfig | None = None
    ) -> None:
        self.name = PolicyName(policy).value
        self.reasons: Counter[str] = Counter()
        self._redis = connect(redis_url, timeout_s=10.0)
        keys = RedisKeys(namespace)
        self._namespace = namespace
        self._publisher = KVIndexPublisher(self._redis, keys, block_ttl_s=_LONG_TTL_S)
        config = dataclasses.replace(
            config or RouterConfig(), policy=PolicyName(self.name), pending_ttl_s=_LONG_TTL_S
        )
        metrics = RouterMetrics()
        index = RouterIndex(
            KVIndexReader(self._redis, keys, max_blocks_per_engine=config.max_blocks_per_engine),
            metrics,
            provisional_ttl_s=config.provisional_ttl_s,
            pending_ttl_s=config.pending_ttl_s,
        )
        self._router = Router(index, OpenDiscovery(), make_policy(self.name, config), metrics)
        self._uses_index = self.name == PolicyName.PREFIX.value

    async def start(self, engines: list[SimEngine]) -> None:
        for e in engines:
            await self._publisher.publish_heartbeat(heartbeat(e, 0.0), ttl_s=_LONG_TTL_S)

    async def route(self, req: SimRequest, engines: dict[str, SimEngine]) -> str:
        hashes = req.prompt_hashes if self._uses_index else []
        resp = await self._router.route(
            RouteRequest(MODEL, hashes, req.prompt_len, request_id=req.rid)
        )
        self.reasons[resp.reason] += 1
        return resp.engine_id

    async def publish(self, engine: SimEngine, now: float) -> None:
        """One publisher tick: pending KV events, then the heartbeat (which resets the routers'
        pending count). Skipped when nothing changed since the last tick."""
        load = (engine.num_running, engine.num_waiting)
        if not engine.unpublished and not engine.routed_since_publish and load == engine.published:
            return
        if engine.unpublished:
            events, engine.unpublished = engine.unpublished, []
            if self._uses_index:
                await self._publisher.apply_events(engine.engine_id, MODEL, events)
        engine.routed_since_publish = 0
        engine.published = load
        await self._publisher.publish_heartbeat(heartbeat(engine, now), ttl_s=_LONG_TTL_S)

    async def close(self) -> None:
        async for key in self._redis.scan_iter(match=f"{self._namespace}:*", count=1000):
            await self._redis.unlink(key)
        await self._redis.aclose()


class OracleRouting:
    """The prefix policy with perfect information (an upper bound for the index)."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.name = ORACLE
        self.reasons: Counter[str] = Counter()
        self._policy = make_policy(PolicyName.PREFIX, config or RouterConfig())
        self._turn = 0

    async def start(self, engines: list[SimEngine]) -> None:
        return None

    async def route(self, req: SimRequest, engines: dict[str, SimEngine]) -> str:
        hashes = req.prompt_hashes
        candidates = [
            Candidate(
                e.engine_id,
                e.url,
                e.exact_match(hashes),
                e.num_running,
                e.num_waiting,
                0,
                e.bm.usage,
            )
            for e in engines.values()
        ]
        ctx = PolicyContext(MODEL, len(hashes), self._counter)
        decision = await self._policy.choose(candidates, ctx)
        self.reasons[decision.reason] += 1
        return decision.candidate.engine_id

    async def publish(self, engine: SimEngine, now: float) -> None:
        engine.unpublished.clear()
        engine.routed_since_publish = 0

    async def close(self) -> None:
        return None

    async def _counter(self) -> int:
        self._turn += 1
        return self._turn
