"""Engine pods' ``controller.kubernetes.io/pod-deletion-cost``, kept current from what each
engine's prefix cache is worth to recent traffic, so that when a Deployment scales in,
Kubernetes removes the engine whose cache is coldest (the ReplicaSet controller deletes pods
of lower cost first).

Worth = prefix blocks served: the blocks of the prompts routed to an engine that the index said
it already held (``Candidate.matched_blocks`` of each choice), summed over a sliding window
(``--deletion-cost-window-s``, 5 min by default).

Lifecycle. ``PrefixHits`` observes every routing choice (in process, no I/O). Every
``--deletion-cost-interval-s`` the ``DeletionCost`` task of each replica adds its counts to
Redis (one hash per model and time bucket, expiring with the window), so every replica sees the
whole fleet's hits; then the one replica holding the writer lease (a Redis key, renewed each
pass) sums the window and patches the pods whose value changed: at most
``MAX_WRITES_PER_PASS`` patches a pass, values rounded to two significant digits (so a busy
engine's annotation does not change on every pass), a pod written again only when its value
changes. Pods are the ones the EndpointSlice watch lists (``targetRef`` names = the engines'
ids, the pod names): the router never patches a pod outside its engines' Service. The chart's
RBAC gives it ``patch`` on pods of its namespace only, and its admission policy narrows that to
this release's engine pods and to this one annotation.

Without Kubernetes discovery nothing is patched. Redis or the API server being down costs only
freshness: the pass is skipped and retried at the next interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from services.protocol.messages import RouteRequest
from services.protocol.redis_schema import RedisKeys
from services.router.index import REDIS_ERRORS, RouterIndex
from services.router.policies import Candidate

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

    from services.router.discovery import KubernetesDiscovery

logger = logging.getLogger(__name__)

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
MAX_WRITES_PER_PASS = 32
FIELD_MANAGER = "pagoda-router"
_BUCKETS_PER_WINDOW = 5
_INT32_MAX = 2**31 - 1


def quantized(value: int) -> int:
    """``value`` rounded down to two significant digits (12345 -> 12000), within int32."""
    value = min(max(0, value), _INT32_MAX)
    if value < 100:
        return value
    step = 10 ** (len(str(value)) - 2)
    return value // step * step


class PrefixHits:
    """Route observer: prefix blocks each engine was chosen for since the last ``take()``."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    async def observe(self, req: RouteRequest, chosen: Candidate | None) -> None:
        if chosen is not None and chosen.matched_blocks > 0:
            key = (req.model, chosen.engine_id)
            self._counts[key] = self._counts.get(key, 0) + chosen.matched_blocks

    def take(self) -> dict[tuple[str, str], int]:
        counts, self._counts = self._counts, {}
        return counts


class HitWindow:
    """The fleet's prefix hits in Redis: one hash per model and time bucket."""

    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, window_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._redis = redis
        self._keys = keys
        self.bucket_s = max(window_s / _BUCKETS_PER_WINDOW, 0.05)
        self._buckets = math.ceil(window_s / self.bucket_s)
        self._clock = clock

    async def add(self, counts: Mapping[tuple[str, str], int]) -> None:
        if not counts:
            return
        bucket = int(self._clock() // self.bucket_s)
        expire_ms = int(self.bucket_s * (self._buckets + 1) * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            for (model, engine_id), blocks in counts.items():
                key = self._keys.hits(model, bucket)
                pipe.hincrby(key, engine_id, blocks)
                pipe.pexpire(key, expire_ms)
            await pipe.execute()

    async def totals(self, models: Iterable[str]) -> dict[str, int]:
        """Engine id -> prefix blocks served within the window (the current bucket included)."""
        now = int(self._clock() // self.bucket_s)
        async with self._redis.pipeline(transaction=False) as pipe:
            for model in models:
                for bucket in range(now - self._buckets + 1, now + 1):
                    pipe.hgetall(self._keys.hits(model, bucket))
            replies = await pipe.execute()
        totals: dict[str, int] = {}
        for reply in replies:
            for engine_id, blocks in reply.items():
                name = engine_id.decode() if isinstance(engine_id, bytes) else str(engine_id)
                totals[name] = totals.get(name, 0) + int(blocks)
        return totals


class PodAnnotator:
    """Patches one annotation of pods in one namespace (the blocking client, in a thread)."""

    def __init__(self, api_client_factory: Callable[[], ApiClient], namespace: str) -> None:
        self._factory = api_client_factory
        self.namespace = namespace
        self._api: Any = None

    async def set(self, pod: str, value: int) -> bool:
        """Writes ``value``; False when the pod is gone. Raises the client's ApiException for
        other refusals (403: RBAC)."""
        return await asyncio.to_thread(self._patch, pod, value)

    def _patch(self, pod: str, value: int) -> bool:
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        if self._api is None:
            self._api = CoreV1Api(self._factory())
        body = {"metadata": {"annotations": {ANNOTATION: str(value)}}}
        try:
            self._api.patch_namespaced_pod(
                pod, self.namespace, body, field_manager=FIELD_MANAGER,
                _content_type="application/merge-patch+json", _request_timeout=(5.0, 10.0),
            )
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def close(self) -> None:
        if self._api is not None:
            self._api.api_client.close()


class DeletionCost:
    """The periodic pass: flush this replica's hits, and (holding the lease) annotate."""

    def __init__(
        self,
        hits: PrefixHits,
        window: HitWindow,
        annotator: PodAnnotator,
        discovery: KubernetesDiscovery,
        index: RouterIndex,
        redis: aioredis.Redis,
        keys: RedisKeys,
        interval_s: float,
    ) -> None:
        self._hits = hits
        self._window = window
        self._annotator = annotator
        self._discovery = discovery
        self._index = index
        self._redis = redis
        self._lease_key = keys.deletion_cost_turn()
        self._lease_ms = int(interval_s * 3000)  # a writer that stops passing loses it soon
        self._me = uuid.uuid4().hex
        self.interval_s = interval_s
        self.written: dict[str, int] = {}  # pod -> the value this replica last wrote
        self._task: asyncio.Task[None] | None = None
        self._refused = False

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await asyncio.to_thread(self._annotator.close)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.run_once()
            except REDIS_ERRORS as exc:
                self._index.redis_failed("deletion-cost", exc)
            except Exception:  # noqa: BLE001 -- the API server's errors: retry next pass
                logger.exception("pod-deletion-cost pass failed")

    async def run_once(self) -> int:
        """One pass; returns the number of pods patched."""
        counts = self._hits.take()
        if not self._index.redis_available:
            return 0
        await self._window.add(counts)
        if not await self._hold_lease():
            self.written.clear()  # another replica writes; start afresh if we take over
            return 0
        pods = sorted({e.name for e in self._discovery.current().engines if e.name})
        if not pods:
            return 0
        models = await self._index.models()
        totals = await self._window.totals(models if models is not None else [])
        return await self._write({pod: quantized(totals.get(pod, 0)) for pod in pods})

    async def _hold_lease(self) -> bool:
        if await self._redis.set(self._lease_key, self._me, nx=True, px=self._lease_ms):
            return True
        holder = await self._redis.get(self._lease_key)
        if holder is not None and holder.decode() == self._me:
            await self._redis.pexpire(self._lease_key, self._lease_ms)
            return True
        return False

    async def _write(self, costs: dict[str, int]) -> int:
        from kubernetes.client.exceptions import ApiException

        self.written = {p: v for p, v in self.written.items() if p in costs}
        changed = [p for p, v in costs.items() if self.written.get(p) != v]
        # Hottest first: when the pass is capped, the engines worth most are marked first.
        changed.sort(key=lambda p: -costs[p])
        patched = 0
        for pod in changed[:MAX_WRITES_PER_PASS]:
            try:
                if await self._annotator.set(pod, costs[pod]):
                    patched += 1
                self.written[pod] = costs[pod]
            except ApiException as exc:
                if not self._refused:
                    logger.warning("cannot annotate pod %s (%s %s); is the router's RBAC "
                                   "rule for pods installed?", pod, exc.status, exc.reason)
                self._refused = True
                return patched
        if patched:
            logger.debug("pod-deletion-cost written pods=%d", patched)
        self._refused = False
        return patched
