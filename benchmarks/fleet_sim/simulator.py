"""The discrete-event simulation: one trace, one fleet, one routing.

Simulated time only advances through the event heap; Redis calls happen "instantly" in
simulated time (their real cost shows up in the run's wall time, not in TTFT). Events:

    arrival   a session's turn reaches the router -> route -> engine.submit
    step      an engine finishes a (possibly fused) step
    tick      an engine's publisher tick (KV events + heartbeat), every ``publish_interval_s``

A session's next turn is scheduled when its current turn finishes (+ think time).
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.fleet_sim.engine import CostModel, EngineSpec, SimEngine, SimRequest
from benchmarks.fleet_sim.routing import Routing
from benchmarks.fleet_sim.trace import KINDS, Session, Trace


@dataclass(frozen=True, slots=True)
class SimConfig:
    spec: EngineSpec = field(default_factory=EngineSpec)
    cost: CostModel = field(default_factory=CostModel)
    publish_interval_s: float = 1.0  # the real engine's default heartbeat interval
    seed: int = 0


@dataclass(slots=True)
class KindStats:
    requests: int
    hit_rate: float
    ttft_mean_s: float
    ttft_p99_s: float


@dataclass(slots=True)
class RunResult:
    policy: str
    engines: int
    requests: int
    hit_rate: float  # cached prompt tokens / prompt tokens, whole fleet
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    imbalance_requests: float  # max / mean requests served per engine
    imbalance_load: float  # max / mean time-averaged (running + waiting) per engine
    imbalance_busy: float  # max / mean busy time per engine
    utilization: float  # mean fraction of the run an engine spent in steps
    mean_load: float  # mean time-averaged (running + waiting) per engine
    sim_s: float
    wall_s: float
    by_kind: dict[str, KindStats]
    reasons: dict[str, int]
    ttfts: list[float] = field(repr=False)
    served: list[int] = field(repr=False)  # requests per engine
    loads: list[float] = field(repr=False)  # time-averaged running + waiting per engine


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _ratio(values: list[float]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return max(values) / mean if mean > 0 else float("nan")


class Simulation:
    def __init__(self, trace: Trace, engines: int, routing: Routing, config: SimConfig) -> None:
        if config.spec.block_size != trace.config.block_size:
            raise ValueError("the engines' block size must equal the trace's")
        bs = config.spec.block_size
        need = max(
            (-(-(t.prompt_len + t.output_len) // bs) for s in trace.sessions for t in s.turns),
            default=0,
        )
        if need > config.spec.num_blocks:
            raise ValueError(
                f"a request of the trace needs {need} KV blocks but an engine has only "
                f"{config.spec.num_blocks}: raise the KV capacity or lower max_context"
            )
        self.trace = trace
        self.routing = routing
        self.config = config
        self._heap: list[tuple[float, int, Callable[[], object]]] = []
        self._seq = itertools.count()
        self.now = 0.0
        self.engines = [
            SimEngine(f"engine-{i:03d}", config.spec, config.cost, self.schedule, self._finished)
            for i in range(engines)
        ]
        self._by_id = {e.engine_id: e for e in self.engines}
        self.requests: list[SimRequest] = []
        self._arrivals: list[SimRequest] = []
        self._ticks: list[SimEngine] = []
        self._outstanding = trace.num_requests

    def schedule(self, t: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    async def run(self) -> RunResult:
        wall = time.perf_counter()
        await self.routing.start(self.engines)
        for s in self.trace.sessions:
            self._arrive_later(s, 0, s.start_s)
        rng = random.Random(self.config.seed)
        interval = self.config.publish_interval_s
        for e in self.engines:
            self._tick_later(e, rng.uniform(0, interval))
        while self._heap:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()
            while self._arrivals:  # routing is async (Redis): done here, in arrival order
                req = self._arrivals.pop()
                req.engine_id = await self.routing.route(req, self._by_id)
                self._by_id[req.engine_id].submit(req, t)
            while self._ticks:
                e = self._ticks.pop()
                await self.routing.publish(e, t)
        for e in self.engines:
            e.finish_accounting(self.now)
        return self._result(time.perf_counter() - wall)

    # -- events -------------------------------------------------------------------------------

    def _arrive_later(self, session: Session, turn: int, t: float) -> None:
        def arrive() -> None:
            tt = session.turns[turn]
            req = SimRequest(
                f"s{session.sid}-t{turn}",
                session,
                turn,
                tt.prompt_len,
                tt.output_len,
                t,
                self.trace.config.block_size,
            )
            self.requests.append(req)
            self._arrivals.append(req)

        self.schedule(t, arrive)

    def _tick_later(self, engine: SimEngine, t: float) -> None:
        def tick() -> None:
            self._ticks.append(engine)
            if self._outstanding > 0:
                self._tick_later(engine, t + self.config.publish_interval_s)

        self.schedule(t, tick)

    def _finished(self, req: SimRequest, now: float) -> None:
        self._outstanding -= 1
        turns = req.session.turns
        nxt = req.turn + 1
        if nxt < len(turns):
            self._arrive_later(req.session, nxt, now + turns[nxt].think_s)

    # -- results ------------------------------------------------------------------------------

    def _result(self, wall_s: float) -> RunResult:
        reqs = self.requests
        if any(r.finish_s < 0 for r in reqs) or len(reqs) != self.trace.num_requests:
            raise RuntimeError("the simulation ended with unfinished requests")
        ttfts = sorted(r.ttft_s for r in reqs)
        prompt = sum(r.prompt_len for r in reqs)
        cached = sum(r.cached_tokens for r in reqs)
        by_kind: dict[str, KindStats] = {}
        for kind in KINDS:
            rs = [r for r in reqs if r.kind == kind]
            if not rs:
                continue
            kt = sorted(r.ttft_s for r in rs)
            by_kind[kind] = KindStats(
                len(rs),
                sum(r.cached_tokens for r in rs) / max(1, sum(r.prompt_len for r in rs)),
                statistics.fmean(kt),
                _pct(kt, 0.99),
            )
        served = [e.stats.served for e in self.engines]
        duration = max(self.now, 1e-9)
        return RunResult(
            policy=self.routing.name,
            engines=len(self.engines),
            requests=len(reqs),
            hit_rate=cached / max(1, prompt),
            ttft_mean_s=statistics.fmean(ttfts),
            ttft_p50_s=_pct(ttfts, 0.5),
            ttft_p99_s=_pct(ttfts, 0.99),
            imbalance_requests=_ratio([float(s) for s in served]),
            imbalance_load=_ratio([e.stats.load_integral / duration for e in self.engines]),
            imbalance_busy=_ratio([e.stats.busy_s for e in self.engines]),
            utilization=statistics.fmean(e.stats.busy_s for e in self.engines) / duration,
            mean_load=statistics.fmean(e.stats.load_integral for e in self.engines) / duration,
            sim_s=self.now,
            wall_s=wall_s,
            by_kind=by_kind,
            reasons=dict(self.routing.reasons),
            ttfts=ttfts,
            served=served,
            loads=[e.stats.load_integral / duration for e in self.engines],
        )
