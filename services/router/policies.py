"""Routing policies: a ``str`` Enum of names, one Protocol with one async method, a registry.

Every policy is a pure function of its inputs (plus, for round-robin, a counter shared through
Redis), so router replicas that see the same Redis state give the same answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

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

    @property
    def load(self) -> int:
        return self.running + self.waiting + self.pending


@dataclass(frozen=True, slots=True)
class PolicyContext:
    model: str
    num_blocks: int  # blocks in the prompt's chain
    counter: Callable[[], Awaitable[int]]  # next value of a counter shared by all replicas


@dataclass(frozen=True, slots=True)
class Decision:
    candidate: Candidate
    reason: str


class RoutingPolicy(Protocol):
    name: PolicyName

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        """Picks one of ``candidates`` (never empty)."""
        ...


def _by_load(c: Candidate) -> tuple[int, float, str]:
    # The engine id breaks ties so that every replica picks the same engine.
    return (c.load, c.kv_usage, c.engine_id)


def _least_loaded(candidates: Sequence[Candidate]) -> Candidate:
    if not candidates:
        raise ValueError("no candidate engines")
    return min(candidates, key=_by_load)


class LeastLoadedPolicy:
    name = PolicyName.LEAST_LOADED

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
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

    score = matched_blocks / prompt_blocks - load_weight * load / max(1, busiest load)

    The best score wins (ties: lower load, then engine id). Hot-spot guard: when the winner's
    load is at least ``hot_spot_min_load`` and more than ``hot_spot_ratio`` times the least
    busy engine's, the least busy engine gets the request instead: a popular prefix must not
    pile every request onto one engine while others idle.
    """

    load_weight: float = 0.5
    hot_spot_ratio: float = 2.0
    hot_spot_min_load: int = 6
    name: ClassVar[PolicyName] = PolicyName.PREFIX

    async def choose(self, candidates: Sequence[Candidate], ctx: PolicyContext) -> Decision:
        least = _least_loaded(candidates)
        if ctx.num_blocks == 0 or all(c.matched_blocks == 0 for c in candidates):
            return Decision(least, "least-loaded")
        busiest = max(1, max(c.load for c in candidates))

        def rank(c: Candidate) -> tuple[float, int, float, str]:
            score = c.matched_blocks / ctx.num_blocks - self.load_weight * c.load / busiest
            return (-score, c.load, c.kv_usage, c.engine_id)

        best = min(candidates, key=rank)
        if (
            best is not least
            and best.load >= self.hot_spot_min_load
            and best.load > self.hot_spot_ratio * least.load
        ):
            return Decision(least, "hot-spot")
        return Decision(best, "prefix-hit" if best.matched_blocks > 0 else "least-loaded")


PolicyFactory = Callable[[RouterConfig], RoutingPolicy]

_REGISTRY: dict[PolicyName, PolicyFactory] = {
    PolicyName.PREFIX: lambda cfg: PrefixPolicy(
        cfg.load_weight, cfg.hot_spot_ratio, cfg.hot_spot_min_load
    ),
    PolicyName.LEAST_LOADED: lambda cfg: LeastLoadedPolicy(),
    PolicyName.ROUND_ROBIN: lambda cfg: RoundRobinPolicy(),
}


def register_policy(name: PolicyName, factory: PolicyFactory) -> None:
    _REGISTRY[name] = factory


def make_policy(name: PolicyName | str, config: RouterConfig | None = None) -> RoutingPolicy:
    try:
        key = PolicyName(name)
    except ValueError:
        allowed = ", ".join(p.value for p in PolicyName)
        raise ValueError(f"unknown routing policy {name!r}; choose one of {allowed}") from None
    return _REGISTRY[key](config or RouterConfig())
