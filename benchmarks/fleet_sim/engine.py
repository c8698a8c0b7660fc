"""A model of one engine: the real ``Scheduler`` and ``BlockManager``, and a step-time cost model.

Each simulated step is the real engine's step without the model: ``Scheduler.schedule()`` (one
token budget per step, running requests first, chunked prefill, FCFS admission with a real
prefix-cache lookup, preemption by recompute when blocks run out), a step time from the cost
model, then ``Scheduler.update()`` with the session's own next tokens as the sampled ones (so a
finished turn leaves exactly the KV that the session's next prompt hits). A step lasts

    step_overhead_s + prefill_s_per_token x prefill tokens + decode_s_per_seq x decodes

One shortcut, to keep large fleets cheap to simulate: consecutive decode-only steps with nothing
waiting are one event, up to the next request that finishes or as far as the free blocks surely
last (an arrival cuts it short at the next step boundary). Their schedule/update calls run
together when the event ends, so the router sees that stretch's KV events at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.fleet_sim.trace import MODEL, Session
from services.engine.block_manager import BlockManager
from services.engine.request import Request
from services.engine.scheduler import Scheduler, SchedulerOutput
from services.protocol.block_hash import BlockHash, BlockHasher
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time; the defaults are in the range of an 8B model on one datacenter GPU."""

    step_overhead_s: float = 0.006
    prefill_s_per_token: float = 0.00008  # 12.5k prompt tokens/s
    decode_s_per_seq: float = 0.00025

    def __post_init__(self) -> None:
        if self.step_overhead_s <= 0 or self.prefill_s_per_token < 0 or self.decode_s_per_seq < 0:
            raise ValueError("step_overhead_s must be > 0 and the per-token costs >= 0")

    def step_s(self, prefill_tokens: int, decodes: int) -> float:
        return (
            self.step_overhead_s
            + self.prefill_s_per_token * prefill_tokens
            + self.decode_s_per_seq * decodes
        )


@dataclass(frozen=True, slots=True)
class EngineSpec:
    num_blocks: int = 4096  # KV capacity in blocks (x block_size tokens)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


@dataclass(slots=True, eq=False)
class SimRequest:
    rid: str
    session: Session
    turn: int
    prompt_len: int
    output_len: int
    arrival_s: float
    block_size: int
    engine_id: str = ""
    route_reason: str = ""
    cached_tokens: int = 0
    first_token_s: float = -1.0
    finish_s: float = -1.0

    @property
    def kind(self) -> str:
        return self.session.kind

    @property
    def prompt_hashes(self) -> list[BlockHash]:
        return self.session.hashes[: self.prompt_len // self.block_size]

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


@dataclass(slots=True)
class EngineStats:
    served: int = 0
    busy_s: float = 0.0
    load_integral: float = 0.0  # integral of (running + waiting) dt
    steps: int = 0


ScheduleAt = Callable[[float, Callable[[], None]], None]
# Every simulated request: max_tokens comes from the trace, and no token ends it early.
_PARAMS = SamplingParams(max_tokens=None, ignore_eos=True)


class SimEngine:
    """One engine; ``submit`` a request, the engine calls ``on_finish`` when it is done.

    ``schedule(t, fn)`` (given by the simulation) runs ``fn`` at simulated time ``t``."""

    def __init__(
        self,
        engine_id: str,
        spec: EngineSpec,
        cost: CostModel,
        schedule: ScheduleAt,
        on_finish: Callable[[SimRequest, float], None],
    ) -> None:
        self.engine_id = engine_id
        self.url = f"http://{engine_id}.sim:8000"
        self.spec = spec
        self.cost = cost
        # Its KV events feed the simulated router's index, as a real engine's feed Redis.
        self.bm = BlockManager(spec.num_blocks, spec.block_size, record_events=True)
        # No request outgrows the pool (the simulation checks), so the pool is the context.
        self.scheduler = Scheduler(
            self.bm,
            spec.max_num_seqs,
            spec.max_num_batched_tokens,
            spec.num_blocks * spec.block_size,
        )
        self._hasher = BlockHasher(MODEL, spec.block_size)
        self._schedule = schedule
        self._on_finish = on_finish
        self._sims: dict[str, SimRequest] = {}
        self._arrived: list[Request] = []  # submitted during a step: scheduled from the next one
        self.stats = EngineStats()
        # Exact mirror of the prefix cache (from the block manager's own events): the oracle.
        self.cached: set[BlockHash] = set()
        self.unpublished: list[KVEvent] = []  # KV events not yet sent to Redis
        self.routed_since_publish = 0
        self.published: tuple[int, int] = (0, 0)  # (running, waiting) of the last heartbeat
        self._busy = False
        self._version = 0
        self._out = SchedulerOutput()  # the step in flight (the first of a fused stretch)
        self._steps = 0  # steps in the event in flight: > 1 for a fused decode-only stretch
        self._step_start = 0.0
        self._step_end = 0.0
        self._per_step = 0.0
        self._last_change = 0.0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._arrived)

    def exact_match(self, hashes: list[BlockHash]) -> int:
        """Leading blocks of ``hashes`` in the prefix cache right now."""
        n = 0
        cached = self.cached
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    # -- requests -----------------------------------------------------------------------------

    def submit(self, req: SimRequest, now: float) -> None:
        self._account(now)
        req.engine_id = self.engine_id
        self._sims[req.rid] = req
        self._arrived.append(self._request(req))
        self.routed_since_publish += 1
        if not self._busy:
            self._start_step(now)
        elif self._steps > 1:
            self._cut_fused(now)

    def finish_accounting(self, now: float) -> None:
        self._account(now)

    def _request(self, req: SimRequest) -> Request:
        s = req.session
        return Request(
            req.rid,
            s.tokens[: req.prompt_len],
            _PARAMS,
            self._hasher,
            req.output_len,
            block_hashes=list(req.prompt_hashes),  # the trace's chain: nothing to rehash
        )

    # -- steps --------------------------------------------------------------------------------

    def _account(self, now: float) -> None:
        self.stats.load_integral += (now - self._last_change) * (
            self.num_running + self.num_waiting
        )
        self._last_change = now

    def _start_step(self, now: float) -> None:
        for r in self._arrived:
            self.scheduler.add(r)
        self._arrived.clear()
        out = self.scheduler.schedule()
        self._drain_events()  # admissions may have evicted cached blocks
        self._busy = not out.is_empty
        if not self._busy:
            return
        prefill, decodes = _work(out)
        self._out, self._step_start = out, now
        self._per_step = self.cost.step_s(prefill, decodes)
        self._steps = 1 if prefill else self._fusable(out)
        self._end_at(now + self._steps * self._per_step)

    def _fusable(self, out: SchedulerOutput) -> int:
        """Decode-only steps, this one first, that surely run alike: nothing waits, every
        running request decodes, no request finishes before the last one, and the free blocks
        cover every decode's growth (so nothing is preempted)."""
        n = len(out.scheduled)
        if self.scheduler.waiting or n < self.num_running:
            return 1
        left = min(s.request.max_tokens - s.request.num_output_tokens for s in out.scheduled)
        spare = self.bm.num_free_blocks // n * self.spec.block_size + 1
        return max(1, min(left, spare))

    def _end_at(self, t: float) -> None:
        self._step_end = t
        self._version += 1
        version = self._version
        self._schedule(t, lambda: self._end_step(version))

    def _cut_fused(self, now: float) -> None:
        done = int((now - self._step_start) / self._per_step) + 1
        if done < self._steps:
            self._steps = done
            self._end_at(self._step_start + done * self._per_step)

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return  # superseded: a fused step was cut short
        now = self._step_end
        self._account(now)
        self.stats.busy_s += now - self._step_start
        self.stats.steps += self._steps
        self._apply(self._out, now)
        for _ in range(self._steps - 1):  # the rest of a fused stretch
            out = self.scheduler.schedule()
            assert not out.preempted and out.num_batched_tokens == len(self._out.scheduled)
            self._apply(out, now)
        self._drain_events()
        self._start_step(now)

    def _apply(self, out: SchedulerOutput, now: float) -> None:
        """The real scheduler's update, fed each session's next tokens as the sampled ones."""
        tokens = [_next_token(self._sims, s.request) for s in out.scheduled if s.completes_sequence]
        for req in self.scheduler.update(out, tokens):
            sim = self._sims[req.request_id]
            if req.num_output_tokens == 1:
                sim.first_token_s = now
            if req.status.is_finished:
                self._retire(sim, req, now)

    def _retire(self, sim: SimRequest, req: Request, now: float) -> None:
        del self._sims[sim.rid]
        sim.cached_tokens = req.num_cached_tokens
        sim.finish_s = now
        self.stats.served += 1
        self._on_finish(sim, now)

    def _drain_events(self) -> None:
        events = self.bm.take_events()
        if not events:
            return
        cached = self.cached
        for ev in events:
            if ev.kind is KVEventKind.STORED:
                cached.update(ev.block_hashes)
            else:
                cached.difference_update(ev.block_hashes)
        self.unpublished.extend(events)


def _work(out: SchedulerOutput) -> tuple[int, int]:
    """A step's (prefill tokens, decodes): a decode is one new token past the prompt."""
    prefill = decodes = 0
    for s in out.scheduled:
        req = s.request
        if s.num_new_tokens == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
            decodes += 1
        else:
            prefill += s.num_new_tokens
    return prefill, decodes


def _next_token(sims: dict[str, SimRequest], req: Request) -> int:
    """The token the session has after the request's sequence: what the model "samples"."""
    return sims[req.request_id].session.tokens[req.num_tokens]


@dataclass(slots=True)
class Fleet:
    engines: list[SimEngine] = field(default_factory=list)

    def by_id(self) -> dict[str, SimEngine]:
        return {e.engine_id: e for e in self.engines}
