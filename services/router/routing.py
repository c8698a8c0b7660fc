"""One routing decision: look the prompt up, keep the eligible engines, let the policy choose,
write the choice back."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.protocol.messages import RouteRequest, RouteResponse
from services.router.discovery import Discovery, normalize_url
from services.router.index import EngineView, IndexSnapshot, RouterIndex
from services.router.metrics import RouterMetrics
from services.router.policies import Candidate, PolicyContext, RoutingPolicy

logger = logging.getLogger(__name__)


class NoEngineError(Exception):
    """No engine can take the request: 503 when none is live, 409 when all are excluded."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class EngineStatus:
    """One row of ``GET /engines``."""

    model: str
    engine_id: str
    url: str
    running: int
    waiting: int
    pending: int
    kv_usage: float
    free_blocks: int
    total_blocks: int
    block_size: int
    max_model_len: int | None
    discovered: bool


class Router:
    def __init__(
        self,
        index: RouterIndex,
        discovery: Discovery,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
    ) -> None:
        self.index = index
        self.discovery = discovery
        self.policy = policy
        self.metrics = metrics
        self._gauged: set[str] = set()  # models with a live-engines gauge (bounded cardinality)

    async def route(self, req: RouteRequest) -> RouteResponse:
        snapshot = await self.index.lookup(req.model, req.block_hashes)
        eligible = self._eligible(req.model, snapshot)
        if eligible or req.model in self._gauged:  # never a label per unknown model name
            self._gauged.add(req.model)
            self.metrics.live_engines.labels(model=req.model).set(len(eligible))
        excluded = set(req.exclude) | {normalize_url(x) for x in req.exclude}
        candidates = [
            c
            for c in eligible
            if c.engine_id not in excluded and normalize_url(c.url) not in excluded
        ]
        if not candidates:
            status = 409 if eligible else 503
            self.metrics.no_engine.labels(status=str(status)).inc()
            if eligible:
                raise NoEngineError(409, f"every live engine of {req.model!r} is excluded")
            raise NoEngineError(503, f"no live engine serves model {req.model!r}")

        ctx = PolicyContext(
            req.model, len(req.block_hashes), lambda: self.index.next_counter(req.model)
        )
        decision = await self.policy.choose(candidates, ctx)
        chosen = decision.candidate
        await self.index.record_choice(req.model, chosen.engine_id, req.block_hashes, snapshot)

        reason = "degraded" if snapshot.degraded else decision.reason
        policy = self.policy.name.value
        self.metrics.decisions.labels(policy=policy, reason=reason).inc()
        if req.block_hashes:
            self.metrics.matched_ratio.observe(chosen.matched_blocks / len(req.block_hashes))
        logger.debug(
            "routed request_id=%s engine=%s matched=%d reason=%s",
            req.request_id,
            chosen.engine_id,
            chosen.matched_blocks,
            reason,
        )
        return RouteResponse(chosen.engine_id, chosen.url, chosen.matched_blocks, reason, policy)

    async def engines(self, model: str | None = None) -> tuple[list[EngineStatus], bool]:
        """Live engines (all models, or one) and whether the answer is degraded."""
        models = [model] if model else await self.index.models()
        degraded = models is None
        if models is None:
            models = self.index.cached_models()
        allowed = self.discovery.current()
        rows: list[EngineStatus] = []
        for name in models:
            snapshot = await self.index.lookup(name, ())
            degraded = degraded or snapshot.degraded
            for view in snapshot.engines:
                rows.append(_status(name, view, allowed.admits(view.heartbeat)))
        return rows, degraded

    def _eligible(self, model: str, snapshot: IndexSnapshot) -> list[Candidate]:
        allowed = self.discovery.current()
        eligible = [_candidate(v) for v in snapshot.engines if allowed.admits(v.heartbeat)]
        if eligible or not snapshot.degraded or allowed.open:
            return eligible
        # Redis is down and no heartbeat of this model was ever seen (e.g. the router started
        # during the outage): the discovered engines, less those known to serve other models.
        others = self.index.engines_of_other_models(model)
        pending = self.index.local_pending(model)
        out = []
        for e in sorted(allowed.engines, key=lambda e: e.url):
            engine_id = e.name or e.url
            if e.url in others or engine_id in others:
                continue
            out.append(Candidate(engine_id, e.url, 0, 0, 0, pending.get(engine_id, 0), 0.0))
        return out


def _candidate(view: EngineView) -> Candidate:
    hb = view.heartbeat
    return Candidate(
        engine_id=hb.engine_id,
        url=hb.url,
        matched_blocks=view.matched_blocks,
        running=hb.running,
        waiting=hb.waiting,
        pending=view.pending,
        kv_usage=hb.kv_usage,
    )


def _status(model: str, view: EngineView, discovered: bool) -> EngineStatus:
    hb = view.heartbeat
    return EngineStatus(
        model=model,
        engine_id=hb.engine_id,
        url=hb.url,
        running=hb.running,
        waiting=hb.waiting,
        pending=view.pending,
        kv_usage=hb.kv_usage,
        free_blocks=hb.free_blocks,
        total_blocks=hb.total_blocks,
        block_size=hb.block_size,
        max_model_len=hb.max_model_len,
        discovered=discovered,
    )


def status_dict(row: EngineStatus) -> dict[str, Any]:
    return {name: getattr(row, name) for name in row.__slots__}
