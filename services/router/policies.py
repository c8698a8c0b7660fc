"""Routing policies: a ``str`` Enum of names, one Protocol with one async method, a registry.

Every policy is a pure function of its inputs (plus, for round-robin, a counter shared through
Redis), so router replicas that see the same Redis state give the same answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from services.router.adapters import ADAPTER_WEIGHT, affinity
from services.router.config import PolicyName, RouterConfig


@dataclass(frozen=True, slots=True)
class Candidate:
    """One engine a request may go to, as the router sees it now."""

    engine_id: str
    url: str
    matched_blocks: int  # leading blocks of the prompt the index says it holds
    running: int
    waiting: int
    pending: int  # routed by any replica since the engine's last heartbeat
    kv_usage: float
    step_ms: float = 0.0  # the engine's recent step time (0: unknown)
    heartbeat_ts: float = 0.0  # the heartbeat's timestamp, by the engine's own clock
    # Where it holds the request's LoRA adapter (services.protocol.lora_api residency codes);
    # -1: not held, or the request names none.
    adapter: int = -1
    reach_blocks: int = 0  # leading blocks in its pool or host tier (KV tiers; >= matched)
    shared_blocks: int = 0  # leading blocks in the model's shared KV store (every engine's)
    kv_role: str = "both"  # disaggregated serving: "prefill", "decode" or "both"
    free_blocks: int = 0  # KV blocks it can allocate now (cached ones included; 0: unknown)
    total_blocks: int = 0
    kv_layout: str | None = None  # its KV layout digest (None: no P/D connector)
    kv_transfer_address: str | None = None  # where peers pull from it ("host:port")
    # Leading blocks of the prompt a peer of the same layout holds in its pool or host tier,
    # when more than this engine reaches itself (``services.router.pairing``): pulled, not
    # recomputed.
    peer_blocks: int = 0
    openai_port: int = 0  # its OpenAI front's port (heartbeat's; 0: none advertised)

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.pending

    @property
    def local_blocks(self) -> int:
        """Leading blocks of the prompt in its own pool or host tier."""
        return max(self.matched_blocks, self.reach_blocks)


# Step-time ratios below this are noise (batch mix, a busy neighbour), not a slower engine.
_SLOWER_RATIO = 1.25

Cost = Callable[[Candidate], float]


def load_cost(candidates: Sequence[Candidate]) -> Cost:
    """Each candidate's load in units of the fastest candidate's step time:
    ``(load + 1) * slowdown - 1``. With equal speeds (or unknown step times) that is the plain
    load; an engine twice as slow counts as busy even when idle, since a request waits twice
    as long there for every token."""
    known = [c.step_ms for c in candidates if c.step_ms > 0]
    if len(known) < 2:
        return lambda c: float(c.load)
    fastest = min(known)

    def cost(c: Candidate) -> float:
        ratio = c.step_ms / fastest if c.step_ms > 0 else 1.0
        if ratio < _SLOWER_RATIO:
            return float(c.load)
        return (c.load + 1) * ratio - 1

    return cost


@dataclass(frozen=True, slots=True)
class PolicyContext:
    model: str
    num_blocks: int  # blocks in the prompt's chain
    counter: Callable[[], Awaitable[int]]  # next value of a counter shared by all replicas
    role: str | None = None  # the P/D leg ("prefill", "decode"), None: an aggregated request


@dataclass(frozen=True, slots=True)
class Decision:
    candidate: Candidate
    reason: str


class RoutingPolicy(Protocol):
    name: PolicyName

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        """Picks one of ``candidates`` (never empty)."""
        ...


def _least_loaded(candidates: Sequence[Candidate], cost: Cost | None = None) -> Candidate:
    if not candidates:
        raise ValueError("no candidate engines")
    cost = cost or load_cost(candidates)
    # The engine id breaks ties so that every replica picks the same engine.
    return min(candidates, key=lambda c: (cost(c), c.kv_usage, c.engine_id))


# The decode leg: a decode engine's KV fills as its requests grow, and one that runs out
# preempts (recomputes) a running request; the nearer full, the likelier. So KV counts as
# ``used / (1 - used)``, which grows without bound as it fills: half full weighs as much as
# being the busiest engine at ``DECODE_KV_WEIGHT`` 1, nearly full outweighs any load.
DECODE_KV_WEIGHT = 0.5


def decode_choice(candidates: Sequence[Candidate], prompt_blocks: int) -> Decision:
    """The P/D decode leg, by load and free KV (the prompt's blocks come from the prefill
    engine, so no prefix counts): engines without free blocks for the prompt lose to any with
    room; then the least of ``cost / busiest cost + kv_weight x u / (1 - u)``, u the KV usage
    once the prompt is in."""
    if not candidates:
        raise ValueError("no candidate engines")
    cost = load_cost(candidates)
    busiest = max(1.0, max(cost(c) for c in candidates))
    need = prompt_blocks + 1  # the prompt's full blocks, its partial one and the output's

    def rank(c: Candidate) -> tuple[bool, float, float, str]:
        short = c.total_blocks > 0 and c.free_blocks < need
        used = c.kv_usage + (need / c.total_blocks if c.total_blocks > 0 else 0.0)
        pressure = min(used, 0.99) / (1.0 - min(used, 0.99))
        return (short, cost(c) / busiest + DECODE_KV_WEIGHT * pressure, c.kv_usage,
                c.engine_id)

    return Decision(min(candidates, key=rank), "decode-load")


class LeastLoadedPolicy:
    name = PolicyName.LEAST_LOADED

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        if ctx.role == "decode":
            return decode_choice(candidates, ctx.num_blocks)
        return Decision(_least_loaded(candidates), "least-loaded")


class RoundRobinPolicy:
    """Takes turns in engine-id order; the turn counter lives in Redis (INCR), so requests
    spread evenly however they are spread over router replicas."""

    name = PolicyName.ROUND_ROBIN

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        if not candidates:
            raise ValueError("no candidate engines")
        ordered = sorted(candidates, key=lambda c: c.engine_id)
        turn = await ctx.counter()
        return Decision(ordered[(turn - 1) % len(ordered)], "round-robin")


@dataclass(frozen=True, slots=True)
class PrefixPolicy:
    """Longest cached prefix weighed against load, with a hot-spot guard.

    score = matched_blocks / prompt_blocks + adapter_weight * adapter affinity
            - load_weight * cost / max(1, busiest cost)

    where cost is the load scaled by how much slower than the fastest candidate an engine steps
    (``load_cost``; the plain load when speeds are alike). The best score wins (ties: lower
    cost, then engine id). Hot-spot guard: when the winner's
    load is at least ``hot_spot_min_load`` and more than ``hot_spot_ratio`` times the least
    busy engine's, the least busy engine gets the request instead: a popular prefix must not
    pile every request onto one engine while others idle.
    """

    load_weight: float = 0.5
    hot_spot_ratio: float = 2.0
    hot_spot_min_load: int = 6
    # LoRA: how much an engine holding the request's adapter counts (services.router.adapters)
    adapter_weight: float = ADAPTER_WEIGHT
    name: ClassVar[PolicyName] = PolicyName.PREFIX

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        if ctx.role == "decode":
            return decode_choice(candidates, ctx.num_blocks)
        cost = load_cost(candidates)
        least = _least_loaded(candidates, cost)
        adapter = any(c.adapter >= 0 for c in candidates)
        matched = {c.engine_id: tiered_match(c) for c in candidates}
        if not adapter and (ctx.num_blocks == 0 or not any(matched.values())):
            return Decision(least, "least-loaded")
        busiest = max(1.0, max(cost(c) for c in candidates))

        def rank(c: Candidate) -> tuple[float, float, float, str]:
            prefix = matched[c.engine_id] / ctx.num_blocks if ctx.num_blocks else 0.0
            score = (prefix + self.adapter_weight * affinity(c.adapter)
                     - self.load_weight * cost(c) / busiest)
            return (-score, cost(c), c.kv_usage, c.engine_id)

        best = min(candidates, key=rank)
        if (
            best is not least
            and best.load >= self.hot_spot_min_load
            and best.load > self.hot_spot_ratio * least.load
        ):
            return Decision(least, "hot-spot")
        if best.reach_blocks or best.matched_blocks:
            return Decision(best, "prefix-hit")
        if best.peer_blocks:
            return Decision(best, "peer-prefix")
        return Decision(best, "adapter-affinity" if adapter and best is not least
                        else "least-loaded")


# KV tiers' weights (llm-d's): a block in an engine's pool counts 1, in its host memory 0.8
# (it must be copied back first), in the shared store 0.5 (loaded over the network; the same
# for every engine, so it never tells engines apart on its own: load decides). A block on a
# peer engine (its pool or host tier, same KV layout) counts 0.6: pulled engine to engine over
# TCP, one hop and no store in between, yet a network copy and some of the peer's time; still
# far cheaper than recomputing, so a less loaded engine (or one holding the adapter) can win with
# the prefix pulled from the one that holds it.
POOL_WEIGHT, HOST_WEIGHT, PEER_WEIGHT, SHARED_WEIGHT = 1.0, 0.8, 0.6, 0.5


def tiered_match(c: Candidate) -> float:
    """The candidate's prefix in pool-block equivalents: its longest prefix through any tier,
    each block weighted by the best tier that holds it (every tier holds a leading run)."""
    tiers = ((POOL_WEIGHT, c.matched_blocks), (HOST_WEIGHT, c.reach_blocks),
             (PEER_WEIGHT, c.peer_blocks), (SHARED_WEIGHT, c.shared_blocks))
    covered, total = 0, 0.0
    for weight, blocks in sorted(tiers, reverse=True):  # best tier first
        if blocks > covered:
            total += weight * (blocks - covered)
            covered = blocks
    return total


PolicyFactory = Callable[[RouterConfig], RoutingPolicy]

_REGISTRY: dict[PolicyName, PolicyFactory] = {
    PolicyName.PREFIX: lambda cfg: PrefixPolicy(
        cfg.load_weight, cfg.hot_spot_ratio, cfg.hot_spot_min_load
    ),
    PolicyName.LEAST_LOADED: lambda cfg: LeastLoadedPolicy(),
    PolicyName.ROUND_ROBIN: lambda cfg: RoundRobinPolicy(),
}


def make_policy(name: PolicyName | str, config: RouterConfig | None = None) -> RoutingPolicy:
    try:
        key = PolicyName(name)
    except ValueError:
        allowed = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown routing policy {name!r}; choose one of {allowed}") from None
    return _REGISTRY[key](config or RouterConfig())
