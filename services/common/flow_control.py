"""Flow control in front of a model's engines: queue when they are saturated, release fairly.

One implementation for both doors (the gateway's ``/v1/*`` and the router's endpoint picker).
``FlowController.admit(model, tenant, priority)`` returns at once while the model's engines have
headroom, and otherwise waits in a queue per (priority band, tenant) until they do:

- Saturation comes from the engines' own reports (their heartbeats, as the router serves them:
  waiting requests, requests routed since the last heartbeat, KV usage), never from a fixed
  concurrency. An engine has ``queue_depth - waiting - pending`` places while its KV usage is
  under ``kv_usage``; the model's headroom is their sum. Requests released since the last
  snapshot count against it, so a burst is not released on a stale report. No live engine (or
  no report): no flow control (holding for an engine is ``EngineWait``'s job, and a router that
  cannot answer must not stop traffic).
- Bands are strict: a lower priority value (vLLM's order: lower is more urgent) is always
  released first. A request more urgent than every request this door holds or has in flight
  for the model is not held at all: the engines' priority scheduling puts it ahead of all of
  them, and holding it would only add the reports' lag to its first token (one such request
  per band: the next of its band waits its turn). Inside a band tenants take turns (round
  robin), each in arrival order, so a tenant sending ten times the rate of another gets no
  more of the released places while both wait.
- Shedding: a request whose priority is at or past ``sheddable_priority`` that is not released
  within ``shed_after_s`` is refused (``Shed``: a 429 with Retry-After). Others wait until
  released (their caller's own deadline bounds them).
- Freed places: the engines' reports lag a request's end (a heartbeat, then the next read),
  so while requests wait, the end of one this door sent (``finished``) is taken as a place at
  once, for ``credit_s``: the most urgent waiter goes then, not at the next report. A report
  that already counts that end may add it twice: at most the ends of one ``credit_s`` too many
  released, corrected by the next report.
- Bounds: at most ``max_queued`` requests per model and ``max_queued_per_tenant`` per tenant
  and model wait; past either, ``Shed`` at once. A tenant's or band's entry goes when it
  empties, so memory follows what waits now, not every tenant ever seen (a model's entry
  stays: the models are the served ones).

One event loop, no lock. Metrics name bands and tenant ids (the one-way id of the key, never
the key), each through ``BoundedLabels``: the first ``MAX_LABELS`` values seen keep their
name, the rest are "other".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.cli import flag

logger = logging.getLogger(__name__)

MAX_LABELS = 32  # distinct tenants (and bands) a metric names before "other"
ANONYMOUS = "anonymous"  # the tenant of requests without an API key


@dataclass(frozen=True, slots=True)
class FlowConfig:
    enabled: bool = False
    queue_depth: int = 2  # an engine with this many waiting (+ routed since) is saturated
    kv_usage: float = 0.95  # ... or with this KV usage
    sheddable_priority: int | None = None  # priority >= this is sheddable (None: none is)
    shed_after_s: float = 5.0
    max_queued: int = 1024  # per model
    max_queued_per_tenant: int = 256  # per model and tenant
    poll_s: float = 0.02  # how often a waiting queue re-reads the engines' load
    credit_s: float = 0.1  # how long a request's end counts as a place (reports lag it)

    def __post_init__(self) -> None:
        for name in ("queue_depth", "max_queued", "max_queued_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.kv_usage <= 1:
            raise ValueError(f"flow_kv_usage must be in (0, 1], got {self.kv_usage}")
        for name in ("shed_after_s", "poll_s", "credit_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def sheddable(self, priority: int) -> bool:
        return self.sheddable_priority is not None and priority >= self.sheddable_priority


_D = FlowConfig()


@dataclass(frozen=True, slots=True)
class FlowFlags:
    """The flow-control flags, one declaration for both doors: the gateway's and the router's
    configs inherit them (``--flow-control``, ``--flow-queue-depth``, ...)."""

    flow_control: bool = flag(_D.enabled, help="queue requests per priority band and tenant "
                              "while the model's engines are saturated (flow control)")
    flow_queue_depth: int = flag(_D.queue_depth, help="flow control: an engine with this many "
                                 "waiting requests (and routed since its heartbeat) is saturated")
    flow_kv_usage: float = flag(_D.kv_usage, help="flow control: an engine with this KV cache "
                                "usage (0-1) is saturated")
    sheddable_priority: int | None = flag(
        _D.sheddable_priority, help="flow control: requests with a priority at or past this "
        "(vLLM's order: larger is less urgent) are sheddable: a 429 when no engine can take "
        "them within --shed-after-s (default: none is)")
    shed_after_s: float = flag(_D.shed_after_s, help="flow control: how long a sheddable "
                               "request may wait for an engine")
    flow_max_queued: int = flag(_D.max_queued, help="flow control: requests waiting per model "
                                "(past it: 429)")
    flow_max_queued_per_tenant: int = flag(_D.max_queued_per_tenant, help="flow control: "
                                           "requests waiting per model and tenant (past it: 429)")

    def flow_config(self) -> FlowConfig:
        """The controller's settings (raises ValueError on a bad flag)."""
        return FlowConfig(
            enabled=self.flow_control, queue_depth=self.flow_queue_depth,
            kv_usage=self.flow_kv_usage, sheddable_priority=self.sheddable_priority,
            shed_after_s=self.shed_after_s, max_queued=self.flow_max_queued,
            max_queued_per_tenant=self.flow_max_queued_per_tenant,
        )


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What one engine of the model reports (its heartbeat, plus the router's pending)."""

    waiting: int
    pending: int
    kv_usage: float


LoadSource = Callable[[str], Awaitable[Sequence[EngineLoad] | None]]  # None: unknown


def headroom(engines: Sequence[EngineLoad], cfg: FlowConfig) -> int | None:
    """Requests the model's engines can take before all are saturated; None: no engine."""
    if not engines:
        return None
    return sum(max(0, cfg.queue_depth - e.waiting - e.pending)
               for e in engines if e.kv_usage < cfg.kv_usage)


class Shed(Exception):
    """The request is refused: 429 with ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class BoundedLabels:
    """A metric label's values: the first ``limit`` kept, later ones "other"."""

    def __init__(self, limit: int = MAX_LABELS) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) < self.limit:
            self._seen.add(value)
            return value
        return "other"


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str) -> None:
        labels = ["model", "band", "tenant"]
        self.queued = Gauge(f"{prefix}_flow_queued", "Requests waiting in flow control",
                            labels, registry=registry)
        self.released = Counter(f"{prefix}_flow_released",
                                "Requests flow control let through", labels, registry=registry)
        self.shed = Counter(f"{prefix}_flow_shed", "Requests flow control refused (429)",
                            labels + ["reason"], registry=registry)
        self.wait = Histogram(f"{prefix}_flow_wait_seconds",
                              "Time requests waited in flow control", ["model", "band"],
                              registry=registry,
                              buckets=(0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tenant = BoundedLabels()
        self.band = BoundedLabels()


@dataclass(eq=False, slots=True)
class _Waiter:
    tenant: str
    priority: int
    released: asyncio.Future[None]


@dataclass(slots=True)
class _ModelQueue:
    """One model's waiting requests: band -> tenant -> arrival order; turns rotate tenants."""

    bands: dict[int, OrderedDict[str, deque[_Waiter]]] = field(default_factory=dict)
    size: int = 0
    per_tenant: dict[str, int] = field(default_factory=dict)
    # Released since ``snapshot_headroom`` was read (they may not show in the engines' load).
    released_since: int = 0
    snapshot_headroom: int | None = None
    snapshot_at: float = -1.0
    pump: asyncio.Task[None] | None = None
    refresh: asyncio.Future[int | None] | None = None  # a load read in progress
    # Requests let through and not yet ``finished``, by band (entries go at 0).
    in_flight: dict[int, int] = field(default_factory=dict)
    # When requests of this model ended while others waited (``finished``), oldest first.
    freed: deque[float] = field(default_factory=deque)
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # a place freed: pump now

    def push(self, w: _Waiter) -> None:
        band = self.bands.setdefault(w.priority, OrderedDict())
        band.setdefault(w.tenant, deque()).append(w)
        self.size += 1
        self.per_tenant[w.tenant] = self.per_tenant.get(w.tenant, 0) + 1

    def pop_next(self) -> _Waiter | None:
        """The most urgent band's next tenant in turn, its oldest request."""
        if not self.bands:
            return None
        priority = min(self.bands)
        band = self.bands[priority]
        tenant, waiters = next(iter(band.items()))
        w = waiters.popleft()
        band.move_to_end(tenant)  # its turn is over
        self._forget(w, band, waiters)
        return w

    def remove(self, w: _Waiter) -> None:
        band = self.bands.get(w.priority)
        waiters = None if band is None else band.get(w.tenant)
        if waiters is not None and w in waiters:
            waiters.remove(w)
            self._forget(w, band, waiters)

    def _forget(self, w: _Waiter, band: OrderedDict[str, deque[_Waiter]],
                waiters: deque[_Waiter]) -> None:
        self.size -= 1
        self.per_tenant[w.tenant] -= 1
        if not self.per_tenant[w.tenant]:
            del self.per_tenant[w.tenant]
        if not waiters:
            del band[w.tenant]
        if not band:
            del self.bands[w.priority]
        assert self.size >= 0


class FlowController:
    def __init__(self, cfg: FlowConfig, load: LoadSource, metrics: FlowMetrics) -> None:
        self.cfg = cfg
        self._load = load
        self._metrics = metrics
        self._models: dict[str, _ModelQueue] = {}

    def queued(self, model: str) -> int:
        q = self._models.get(model)
        return 0 if q is None else q.size

    def finished(self, model: str, priority: int) -> None:
        """A request this door let through (``admit`` returned) has ended: while others wait,
        its place goes to the next of them now (see the module doc)."""
        q = self._models.get(model)
        if q is None:
            return
        left = q.in_flight.get(priority, 0) - 1
        if left > 0:
            q.in_flight[priority] = left
        else:
            q.in_flight.pop(priority, None)
        if not q.size:
            return  # nobody waits: the reports are enough
        if len(q.freed) < q.size:  # more places than waiters would only be dropped
            q.freed.append(asyncio.get_running_loop().time())
        q.wake.set()

    async def admit(self, model: str, tenant: str | None, priority: int) -> None:
        """Returns once the request may go to an engine. Raises ``Shed``."""
        if not self.cfg.enabled:
            return
        tenant = tenant or ANONYMOUS
        q = self._models.setdefault(model, _ModelQueue())
        passes = not q.size and await self._take(model, q)
        if not passes and self._most_urgent(q, priority):
            q.released_since += 1  # it takes a place of the headroom like any other
            passes = True
        if passes:
            self._let_through(model, q, tenant, priority, 0.0)
            return
        self._check_bounds(model, q, tenant, priority)
        await self._wait(model, q, _Waiter(tenant, priority,
                                           asyncio.get_running_loop().create_future()))

    @staticmethod
    def _most_urgent(q: _ModelQueue, priority: int) -> bool:
        """More urgent than everything waiting and in flight here (see the module doc); False
        when this door has nothing in either (the engines are then busy with others')."""
        bands = (*q.bands, *q.in_flight)
        return bool(bands) and all(priority < band for band in bands)

    def _let_through(self, model: str, q: _ModelQueue, tenant: str, priority: int,
                     waited: float) -> None:
        q.in_flight[priority] = q.in_flight.get(priority, 0) + 1
        self._count_released(model, tenant, priority, waited)

    def _check_bounds(self, model: str, q: _ModelQueue, tenant: str, priority: int) -> None:
        if q.size >= self.cfg.max_queued:
            raise self._shed(model, tenant, priority, "full",
                             f"{self.cfg.max_queued} requests already wait for model {model!r}")
        if q.per_tenant.get(tenant, 0) >= self.cfg.max_queued_per_tenant:
            raise self._shed(model, tenant, priority, "tenant_full",
                             f"{self.cfg.max_queued_per_tenant} of this API key's requests "
                             f"already wait for model {model!r}")

    async def _wait(self, model: str, q: _ModelQueue, w: _Waiter) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        q.push(w)
        gauge = self._gauge(model, w.tenant, w.priority)
        gauge.inc()
        if q.pump is None or q.pump.done():
            q.pump = asyncio.create_task(self._pump(model, q))
        sheddable = self.cfg.sheddable(w.priority)
        try:
            async with asyncio.timeout(self.cfg.shed_after_s if sheddable else None):
                await asyncio.shield(w.released)
        except TimeoutError:
            raise self._shed(model, w.tenant, w.priority, "timeout",
                             f"no engine of model {model!r} could take this sheddable request "
                             f"(priority {w.priority}) within {self.cfg.shed_after_s:g} "
                             "seconds") from None
        finally:
            gauge.dec()
            if not w.released.done():  # shed, or its client went away: it leaves the queue
                q.remove(w)
                w.released.cancel()
        self._let_through(model, q, w.tenant, w.priority, loop.time() - start)

    async def _pump(self, model: str, q: _ModelQueue) -> None:
        """Releases waiters while there is headroom, re-reading the load every ``poll_s``;
        ends when the queue is empty."""
        while q.size:
            while q.size and await self._take(model, q):
                w = q.pop_next()
                assert w is not None
                w.released.set_result(None)
            if q.size:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(q.wake.wait(), self.cfg.poll_s)
                q.wake.clear()
        q.freed.clear()

    async def _take(self, model: str, q: _ModelQueue) -> bool:
        """Takes one place of the model's headroom (from a snapshot at most ``poll_s`` old)."""
        if asyncio.get_running_loop().time() - q.snapshot_at >= self.cfg.poll_s:
            await self._refresh(model, q)
        if q.snapshot_headroom is None:
            return True  # no engine, or no report: not ours to hold
        if q.released_since < q.snapshot_headroom:
            q.released_since += 1
            return True
        return self._take_freed(q)

    def _take_freed(self, q: _ModelQueue) -> bool:
        """One place a request's end freed within ``credit_s``, if any."""
        now = asyncio.get_running_loop().time()
        while q.freed and now - q.freed[0] > self.cfg.credit_s:
            q.freed.popleft()
        if not q.freed:
            return False
        q.freed.popleft()
        return True

    async def _refresh(self, model: str, q: _ModelQueue) -> None:
        """One read of the load at a time per model: concurrent callers share it (else each
        would reset ``released_since`` and a burst would pass one snapshot's headroom)."""
        if q.refresh is None:
            q.refresh = asyncio.ensure_future(self._headroom(model))
            try:
                q.snapshot_headroom = await asyncio.shield(q.refresh)
                q.snapshot_at, q.released_since = asyncio.get_running_loop().time(), 0
            finally:
                q.refresh = None
        else:
            await asyncio.shield(q.refresh)

    async def _headroom(self, model: str) -> int | None:
        try:
            engines = await self._load(model)
        except Exception as exc:  # noqa: BLE001 -- an unknown load never stops traffic
            logger.warning("flow control: no load for model=%s: %s", model, exc)
            return None
        return None if engines is None else headroom(engines, self.cfg)

    def _gauge(self, model: str, tenant: str, priority: int) -> Gauge:
        m = self._metrics
        return m.queued.labels(model, m.band(str(priority)), m.tenant(tenant))

    def _count_released(self, model: str, tenant: str, priority: int, waited: float) -> None:
        m = self._metrics
        band = m.band(str(priority))
        m.released.labels(model, band, m.tenant(tenant)).inc()
        m.wait.labels(model, band).observe(waited)

    def _shed(self, model: str, tenant: str, priority: int, reason: str, message: str) -> Shed:
        m = self._metrics
        m.shed.labels(model, m.band(str(priority)), m.tenant(tenant), reason).inc()
        logger.info("flow control shed model=%s priority=%d reason=%s", model, priority, reason)
        return Shed(message, retry_after=max(1, round(self.cfg.shed_after_s)))
