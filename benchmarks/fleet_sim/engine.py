"""A model of one engine: the real ``BlockManager`` and a step-time cost model.

Each simulated step mirrors the real scheduler (``services.engine.scheduler``): one token
budget per step, running requests first (a decode takes one token, a prefill chunk the rest),
then waiting requests in FCFS order while blocks, the budget and ``max_num_seqs`` allow, each
admission a real prefix-cache lookup (``get_computed_blocks`` + ``allocate_slots``). A step
lasts

    step_overhead_s + prefill_s_per_token x prefill tokens + decode_s_per_seq x decodes

Differences from the real engine, on purpose: a request reserves the blocks of its whole
prompt + output when admitted (so nothing is ever preempted), and steps that only decode are
fused into one event up to the next request that finishes (an arrival cuts it short at the
next step boundary), which keeps large fleets cheap to simulate.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.fleet_sim.trace import Session
from services.engine.block_manager import BlockManager
from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind


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


@dataclass(slots=True, eq=False)
class _Active:
    req: SimRequest
    prefill_left: int
    decode_left: int


@dataclass(slots=True)
class EngineStats:
    served: int = 0
    busy_s: float = 0.0
    load_integral: float = 0.0  # integral of (running + waiting) dt
    steps: int = 0


Scheduler = Callable[[float, Callable[[], None]], None]


class SimEngine:
    """One engine; ``submit`` a request, the engine calls ``on_finish`` when it is done.

    ``schedule(t, fn)`` (given by the simulation) runs ``fn`` at simulated time ``t``."""

    def __init__(
        self,
        engine_id: str,
        spec: EngineSpec,
        cost: CostModel,
        schedule: Scheduler,
        on_finish: Callable[[SimRequest, float], None],
    ) -> None:
        self.engine_id = engine_id
        self.url = f"http://{engine_id}.sim:8000"
        self.spec = spec
        self.cost = cost
        self.bm = BlockManager(spec.num_blocks, spec.block_size)
        self._schedule = schedule
        self._on_finish = on_finish
        self.waiting: deque[SimRequest] = deque()
        self.running: list[_Active] = []
        self.stats = EngineStats()
        # Exact mirror of the prefix cache (from the block manager's own events): the oracle.
        self.cached: set[BlockHash] = set()
        self.unpublished: list[KVEvent] = []  # KV events not yet sent to Redis
        self.routed_since_publish = 0
        self.published: tuple[int, int] = (0, 0)  # (running, waiting) of the last heartbeat
        self._busy = False
        self._version = 0
        self._step_start = 0.0
        self._step_end = 0.0
        self._per_step = 0.0
        self._fused = 0  # > 0: a fused decode-only step of this many steps is in flight
        self._prefill: list[tuple[_Active, int]] = []
        self._decode: list[_Active] = []
        self._last_change = 0.0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

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
        self.waiting.append(req)
        self.routed_since_publish += 1
        if not self._busy:
            self._start_step(now)
        elif self._fused:
            self._cut_fused(now)

    def finish_accounting(self, now: float) -> None:
        self._account(now)

    # -- steps --------------------------------------------------------------------------------

    def _account(self, now: float) -> None:
        self.stats.load_integral += (now - self._last_change) * (
            len(self.running) + len(self.waiting)
        )
        self._last_change = now

    def _start_step(self, now: float) -> None:
        spec = self.spec
        budget = spec.max_num_batched_tokens
        prefill: list[tuple[_Active, int]] = []
        decode: list[_Active] = []
        for act in self.running:
            if budget <= 0:
                break
            if act.prefill_left:
                n = min(act.prefill_left, budget)
                prefill.append((act, n))
                budget -= n
            else:
                decode.append(act)
                budget -= 1
        while self.waiting and budget > 0 and len(self.running) < spec.max_num_seqs:
            act = self._admit(self.waiting[0])
            if act is None:
                break  # FCFS: the head waits for blocks
            self.waiting.popleft()
            self.running.append(act)
            n = min(act.prefill_left, budget)
            prefill.append((act, n))
            budget -= n
        self._drain_events()  # admissions may have evicted cached blocks
        if not prefill and not decode:
            self._busy = False
            return
        self._busy = True
        self._prefill, self._decode = prefill, decode
        self._step_start = now
        if prefill:
            self._fused = 0
            self._per_step = self.cost.step_s(sum(n for _, n in prefill), len(decode))
            self._step_end = now + self._per_step
        else:
            self._per_step = self.cost.step_s(0, len(decode))
            self._fused = min(a.decode_left for a in decode)
            self._step_end = now + self._fused * self._per_step
        self._version += 1
        version = self._version
        self._schedule(self._step_end, lambda: self._end_step(version))

    def _cut_fused(self, now: float) -> None:
        done = int((now - self._step_start) / self._per_step) + 1
        if done < self._fused:
            self._fused = done
            self._step_end = self._step_start + done * self._per_step
            self._version += 1
            version = self._version
            self._schedule(self._step_end, lambda: self._end_step(version))

    def _admit(self, req: SimRequest) -> _Active | None:
        bm = self.bm
        tokens = req.session.tokens
        hashes = req.prompt_hashes
        prompt = tokens[: req.prompt_len]
        hits, num_cached = bm.get_computed_blocks(prompt, hashes)
        if not bm.allocate_slots(req.rid, req.prompt_len + req.output_len, hits):
            return None
        bm.record_prefix_lookup(req.prompt_len, num_cached)
        req.cached_tokens = num_cached
        return _Active(req, req.prompt_len - num_cached, req.output_len)

    def _end_step(self, version: int) -> None:
        if version != self._version:
            return  # superseded: a fused step was cut short
        now = self._step_end
        self._account(now)
        self.stats.busy_s += now - self._step_start
        bs = self.spec.block_size
        if self._fused:
            self.stats.steps += self._fused
            for act in self._decode:
                act.decode_left -= self._fused
        else:
            self.stats.steps += 1
            for act in self._decode:
                act.decode_left -= 1
            for act, n in self._prefill:
                act.prefill_left -= n
                req = act.req
                computed = req.prompt_len - act.prefill_left
                s = req.session
                self.bm.cache_full_blocks(
                    req.rid, s.tokens[: req.prompt_len], s.hashes[: req.prompt_len // bs], computed
                )
                if act.prefill_left == 0:
                    req.first_token_s = now  # the step that ends a prefill samples token 1
                    act.decode_left -= 1
        still: list[_Active] = []
        for act in self.running:
            if act.prefill_left == 0 and act.decode_left <= 0:
                self._retire(act, now)
            else:
                still.append(act)
        self.running = still
        self._drain_events()
        self._start_step(now)

    def _retire(self, act: _Active, now: float) -> None:
        req = act.req
        s = req.session
        total = req.prompt_len + req.output_len
        # The last sampled token is never fed back, so its KV is not computed.
        computed = total - 1
        self.bm.cache_full_blocks(
            req.rid, s.tokens[:total], s.hashes[: computed // self.spec.block_size], computed
        )
        self.bm.free(req.rid)
        req.finish_s = now
        self.stats.served += 1
        self._on_finish(req, now)

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


@dataclass(slots=True)
class Fleet:
    engines: list[SimEngine] = field(default_factory=list)

    def by_id(self) -> dict[str, SimEngine]:
        return {e.engine_id: e for e in self.engines}
