"""One routing decision: look the prompt up, keep the eligible engines, let the policy choose,
write the choice back."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import trace

from services.common import tracing
from services.protocol.messages import RouteRequest, RouteResponse
from services.router.adapters import with_adapter
from services.router.discovery import Discovery, normalize_url
from services.router.index import EngineView, IndexSnapshot, RouterIndex
from services.router.metrics import RouterMetrics
from services.router.pairing import PeerTier, paired_decode, paired_prefill
from services.router.policies import Candidate, Decision, PolicyContext, RoutingPolicy

logger = logging.getLogger(__name__)

_MAX_TRACED_CANDIDATES = 32  # per-candidate lists in the decision span stop here
# A gateway excludes an engine after it failed a request before the first token (refused the
# connection, died, hung, 5xx, 429). The router then avoids that engine for every request for
# this long, unless nothing else is left, or until the engine publishes a heartbeat newer than
# the one the router saw when it failed: a SIGKILLed engine stops getting traffic at the first
# failure instead of when its heartbeat expires, and one that recovers (a hang ends, a restart)
# is back in rotation with its next heartbeat, not seconds later.
DEFAULT_SUSPECT_S = 5.0
_MAX_SUSPECTS = 1024


@dataclass(frozen=True, slots=True)
class _Suspicion:
    until: float  # monotonic deadline
    # The engine's heartbeat timestamp when it failed (its own clock; None: it had no live
    # heartbeat). A newer one proves it alive again.
    heartbeat: float | None

    def holds(self, now: float, heartbeat: float) -> bool:
        return now < self.until and (self.heartbeat is not None and heartbeat <= self.heartbeat)


class RouteObserver(Protocol):
    """Told every answer of ``/route``: the demand metrics and the prefix-hit window."""

    async def observe(self, req: RouteRequest, chosen: Candidate | None) -> None:
        """``chosen`` is None when no engine of the model is live (a 503). Never raises."""
        ...


@dataclass(frozen=True, slots=True)
class Pick:
    """A decision with the runners-up, for callers that take an ordered fallback list (the
    endpoint picker): ``ranked[0]`` is the policy's choice, the rest by prefix then load.
    ``settle``: the choice's write-back, when the caller asked to run it after answering
    (None: already written)."""

    response: RouteResponse
    ranked: list[Candidate]
    settle: Callable[[], Awaitable[None]] | None = None


Admit = Callable[[Candidate], bool]


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
    hash_algorithm: str
    adapters: list[dict[str, Any]]  # the engine's LoRA adapters (lora_api.AdapterStatus)
    kv_role: str  # disaggregated serving: prefill, decode or both
    kv_layout: str | None  # its KV layout digest (engines with a P/D connector)
    kv_transfer_address: str | None


class Router:
    def __init__(
        self,
        index: RouterIndex,
        discovery: Discovery,
        policy: RoutingPolicy,
        metrics: RouterMetrics,
        tracer: trace.Tracer | None = None,
        suspect_s: float = DEFAULT_SUSPECT_S,
        observers: Sequence[RouteObserver] = (),
    ) -> None:
        self.index = index
        self.observers = tuple(observers)
        self.suspect_s = suspect_s
        self._suspects: dict[str, _Suspicion] = {}  # by engine id or URL
        self.discovery = discovery
        self.policy = policy
        self.metrics = metrics
        self.tracer = tracer or tracing.get_tracer()
        self._traced = tracing.is_enabled(self.tracer)
        self._gauged: set[str] = set()  # models with a live-engines gauge (bounded cardinality)

    async def route(self, req: RouteRequest) -> RouteResponse:
        """One decision, in a ``router.decision`` span. Raises NoEngineError."""
        return (await self.pick(req)).response

    async def pick(self, req: RouteRequest, admit: Admit | None = None, *,
                   settle_later: bool = False) -> Pick:
        """``route``, among the engines ``admit`` accepts (all when None), with the runners-up.
        Raises NoEngineError (503 when ``admit`` leaves none). ``settle_later``: the choice's
        write-back (the provisional blocks, one more pending, the observers) is left to the
        caller as ``Pick.settle``, to run once it has answered: the endpoint picker's answer
        does not wait for a Redis round trip that only later requests read."""
        if not self._traced:
            return await self._route(req, trace.INVALID_SPAN, admit, settle_later)
        with self.tracer.start_as_current_span("router.decision") as span:
            return await self._route(req, span, admit, settle_later)

    async def _route(self, req: RouteRequest, span: trace.Span, admit: Admit | None,
                     settle_later: bool = False) -> Pick:
        start = time.perf_counter()
        snapshot = await self.index.lookup(req.model, req.block_hashes)
        lookup_s = time.perf_counter() - start
        eligible = self._eligible(req.model, snapshot)
        self._gauge_live(req.model, len(eligible))
        if admit is not None:
            eligible = [c for c in eligible if admit(c)]
        candidates, paired, peers = self._narrow(req, eligible, snapshot)
        if span.is_recording():
            _trace_lookup(span, req, self.policy.name.value, snapshot.degraded, lookup_s,
                          len(eligible), candidates)
        if not candidates:
            status = 409 if eligible else 503
            self.metrics.no_engine.labels(status=str(status)).inc()
            if eligible:
                raise NoEngineError(409, f"every live engine of {req.model!r} is excluded")
            for observer in self.observers:
                await observer.observe(req, None)
            raise NoEngineError(503, f"no live engine serves model {req.model!r}")

        ctx = PolicyContext(
            req.model, len(req.block_hashes), lambda: self.index.next_counter(req.model),
            _policy_role(req),
        )
        decision = await self.policy.choose(candidates, ctx)
        chosen = decision.candidate

        async def settle() -> None:
            await self.index.record_choice(req.model, chosen.engine_id, req.block_hashes,
                                           snapshot)
            for observer in self.observers:
                await observer.observe(req, chosen)

        if not settle_later:
            await settle()

        reason = ("degraded" if snapshot.degraded else decision.reason if paired
                  else "unpaired")
        policy = self.policy.name.value
        self.metrics.decisions.labels(policy=policy, reason=reason).inc()
        if req.block_hashes:
            self.metrics.matched_ratio.observe(chosen.matched_blocks / len(req.block_hashes))
        if span.is_recording():
            _trace_choice(span, req, decision, reason)
        logger.debug(
            "routed request_id=%s engine=%s matched=%d reason=%s",
            req.request_id,
            chosen.engine_id,
            chosen.matched_blocks,
            reason,
        )
        kv_peer = peers.peer_of(chosen) if peers is not None else None
        response = RouteResponse(chosen.engine_id, chosen.url, chosen.matched_blocks, reason,
                                 policy, kv_peer, chosen.kv_layout)
        rest = sorted((c for c in candidates if c is not chosen),
                      key=lambda c: (-c.matched_blocks, c.load, c.engine_id))
        return Pick(response, [chosen, *rest], settle if settle_later else None)

    def _narrow(self, req: RouteRequest, eligible: list[Candidate], snapshot: IndexSnapshot
                ) -> tuple[list[Candidate], bool, PeerTier | None]:
        """The engines that may take the request (not excluded, of its P/D role, paired by KV
        layout, holding its adapter), with peer blocks counted; whether a decode leg's layout
        pairing held; the peer tier (None on a decode leg that pulls a prefill's blocks)."""
        excluded = set(req.exclude) | {normalize_url(x) for x in req.exclude}
        reachable = [
            c
            for c in eligible
            if c.engine_id not in excluded and normalize_url(c.url) not in excluded
        ]
        candidates = reachable
        if req.role is not None:  # a P/D leg: engines of its role, or of both
            candidates = [c for c in candidates if c.kv_role in (req.role, "both")]
        candidates = self._avoid_suspects(req.exclude, eligible, candidates)
        paired = True
        if req.role == "prefill":
            candidates = paired_prefill(candidates, reachable)
        elif req.role == "decode":
            candidates, paired = paired_decode(candidates, req.kv_layout)
        if req.lora_name is not None and candidates:
            candidates = with_adapter(candidates, snapshot, req.lora_name)
        if _pulls_a_prefill(req):
            return candidates, paired, None
        peers = PeerTier([c for c in reachable if not self._suspected(c)])
        return peers.annotate(candidates), paired, peers

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
            # The gateways poll this, so the gauge stays fresh for models without traffic.
            self._gauge_live(name, len(self._eligible(name, snapshot)))
        return rows, degraded

    def _avoid_suspects(self, exclude: list[str], eligible: list[Candidate],
                        candidates: list[Candidate]) -> list[Candidate]:
        """Records the engines this request excludes as suspects, and drops every current
        suspect from ``candidates`` unless that would leave none."""
        if exclude:
            self._suspect(exclude, eligible, time.monotonic())
        if not self._suspects:
            return candidates
        healthy = [c for c in candidates if not self._suspected(c)]
        return healthy or candidates

    def _suspected(self, c: Candidate) -> bool:
        if not self._suspects:
            return False
        now, suspects = time.monotonic(), self._suspects
        return any(s is not None and s.holds(now, c.heartbeat_ts)
                   for s in (suspects.get(c.engine_id), suspects.get(c.url)))

    def _suspect(self, exclude: list[str], eligible: list[Candidate], now: float) -> None:
        if len(self._suspects) >= _MAX_SUSPECTS:
            self._suspects = {k: s for k, s in self._suspects.items() if s.until > now}
        beats: dict[str, float] = {}
        for c in eligible:
            beats[c.engine_id] = beats[c.url] = beats[normalize_url(c.url)] = c.heartbeat_ts
        for x in exclude:
            old = self._suspects.get(x)
            if old is None or old.until <= now:
                logger.info("engine %s failed a request; avoiding it for %.1fs or until its "
                            "next heartbeat", x, self.suspect_s)
            beat = beats.get(x, beats.get(normalize_url(x)))
            self._suspects[x] = _Suspicion(now + self.suspect_s, beat)

    def _gauge_live(self, model: str, live: int) -> None:
        if live or model in self._gauged:  # never a label per unknown model name
            self._gauged.add(model)
            self.metrics.live_engines.labels(model=model).set(live)

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


def _trace_lookup(
    span: trace.Span,
    req: RouteRequest,
    policy: str,
    degraded: bool,
    lookup_s: float,
    num_eligible: int,
    candidates: list[Candidate],
) -> None:
    shown = candidates[:_MAX_TRACED_CANDIDATES]
    span.set_attributes({
        "gen_ai.request.model": req.model,
        "pagoda.router.policy": policy,
        "pagoda.request_id": req.request_id or "",
        "pagoda.router.prompt_blocks": len(req.block_hashes),
        "pagoda.router.lookup_time_s": lookup_s,
        "pagoda.router.degraded": degraded,
        "pagoda.router.eligible": num_eligible,
        "pagoda.router.excluded": len(req.exclude),
        "pagoda.router.candidates": len(candidates),
        "pagoda.router.candidate_ids": [c.engine_id for c in shown],
        "pagoda.router.candidate_matched_blocks": [c.matched_blocks for c in shown],
        "pagoda.router.candidate_loads": [c.load for c in shown],
    })


def _trace_choice(span: trace.Span, req: RouteRequest, decision: Decision, reason: str) -> None:
    chosen = decision.candidate
    blocks = len(req.block_hashes)
    span.set_attributes({
        "pagoda.router.reason": reason,
        "pagoda.router.matched_blocks": chosen.matched_blocks,
        "pagoda.router.matched_block_ratio": chosen.matched_blocks / blocks if blocks else 0.0,
        "pagoda.engine.id": chosen.engine_id,
        "pagoda.engine.url": chosen.url,
    })


def _pulls_a_prefill(req: RouteRequest) -> bool:
    """A decode leg that pulls a prefill engine's blocks (it names their layout). A decode leg
    without one (a short prompt, one whose prefix a decode engine holds, a failed prefill
    leg) computes its prompt: it is routed as an aggregated request among the decode
    engines, by prefix, load and the peer tier."""
    return req.role == "decode" and req.kv_layout is not None


def _policy_role(req: RouteRequest) -> str | None:
    """The leg the policy weighs: a decode leg that computes its prompt is weighed as an
    aggregated request (its prefix counts)."""
    return None if req.role == "decode" and not _pulls_a_prefill(req) else req.role


def _candidate(view: EngineView) -> Candidate:
    hb = view.heartbeat
    return Candidate(
        engine_id=hb.engine_id,
        url=hb.url,
        matched_blocks=view.matched_blocks,
        reach_blocks=view.reach_blocks,
        shared_blocks=view.shared_blocks,
        running=hb.running,
        waiting=hb.waiting,
        pending=view.pending,
        kv_usage=hb.kv_usage,
        step_ms=hb.step_ms,
        heartbeat_ts=hb.timestamp,
        kv_role=hb.kv_role,
        free_blocks=hb.free_blocks,
        total_blocks=hb.total_blocks,
        kv_layout=hb.kv_layout,
        kv_transfer_address=hb.kv_transfer_address,
        openai_port=hb.openai_port,
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
        hash_algorithm=hb.hash_algorithm,
        adapters=[a.to_dict() for a in hb.adapters],
        kv_role=hb.kv_role,
        kv_layout=hb.kv_layout,
        kv_transfer_address=hb.kv_transfer_address,
    )


def status_dict(row: EngineStatus) -> dict[str, Any]:
    return {name: getattr(row, name) for name in row.__slots__}
