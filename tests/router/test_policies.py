"""Routing policies as pure functions of their inputs."""

from __future__ import annotations

import itertools

import pytest

from services.router.config import PolicyName, RouterConfig
from services.router.policies import (
    Candidate,
    LeastLoadedPolicy,
    PolicyContext,
    PrefixPolicy,
    RoundRobinPolicy,
    make_policy,
)

pytestmark = pytest.mark.asyncio


def cand(engine_id: str, matched: int = 0, running: int = 0, waiting: int = 0, pending: int = 0,
         kv: float = 0.0) -> Candidate:  # fmt: skip
    return Candidate(engine_id, f"http://{engine_id}:8000", matched, running, waiting, pending, kv)


def ctx(num_blocks: int = 10) -> PolicyContext:
    counter = itertools.count(1)

    async def next_value() -> int:
        return next(counter)

    return PolicyContext("m", num_blocks, next_value)


async def test_prefix_prefers_the_longest_match_at_equal_load() -> None:
    policy = PrefixPolicy()
    d = await policy.choose([cand("a", 2), cand("b", 9), cand("c", 5)], ctx())
    assert (d.candidate.engine_id, d.reason) == ("b", "prefix-hit")


async def test_prefix_weighs_load_against_match() -> None:
    policy = PrefixPolicy(load_weight=0.5, hot_spot_ratio=100, hot_spot_min_load=1000)
    # 10% more prefix is not worth being the busiest engine...
    d = await policy.choose([cand("a", 6, running=10), cand("b", 5, running=1)], ctx())
    assert d.candidate.engine_id == "b"
    # ...but a full match against nothing is.
    d = await policy.choose([cand("a", 10, running=10), cand("b", 0, running=1)], ctx())
    assert d.candidate.engine_id == "a"


async def test_no_match_means_least_loaded() -> None:
    d = await PrefixPolicy().choose([cand("a", running=3), cand("b", waiting=1)], ctx())
    assert (d.candidate.engine_id, d.reason) == ("b", "least-loaded")
    d = await PrefixPolicy().choose([cand("a", running=3), cand("b", waiting=1)], ctx(0))
    assert d.candidate.engine_id == "b"


async def test_hot_spot_guard_balances() -> None:
    policy = PrefixPolicy(load_weight=0.1, hot_spot_ratio=2.0, hot_spot_min_load=4)
    hot = [cand("a", 10, running=8), cand("b", 0, running=1), cand("c", 0, running=3)]
    d = await policy.choose(hot, ctx())
    assert (d.candidate.engine_id, d.reason) == ("b", "hot-spot")
    # Below the minimum load the prefix still wins.
    warm = [cand("a", 10, running=3), cand("b", 0, running=0)]
    d = await policy.choose(warm, ctx())
    assert (d.candidate.engine_id, d.reason) == ("a", "prefix-hit")
    # Within the ratio, too.
    busy = [cand("a", 10, running=8), cand("b", 0, running=5)]
    assert (await policy.choose(busy, ctx())).candidate.engine_id == "a"


async def test_pending_counts_as_load() -> None:
    d = await LeastLoadedPolicy().choose([cand("a", pending=2), cand("b", running=1)], ctx())
    assert d.candidate.engine_id == "b"


async def test_ties_break_the_same_way_everywhere() -> None:
    cands = [cand("c"), cand("a"), cand("b")]
    for policy in (PrefixPolicy(), LeastLoadedPolicy()):
        for order in itertools.permutations(cands):
            assert (await policy.choose(list(order), ctx())).candidate.engine_id == "a"


async def test_round_robin_uses_the_shared_counter_in_id_order() -> None:
    c = ctx()
    policy = RoundRobinPolicy()
    picks = [(await policy.choose([cand("b"), cand("a"), cand("c")], c)).candidate.engine_id
             for _ in range(6)]  # fmt: skip
    assert picks == ["a", "b", "c", "a", "b", "c"]


async def test_registry() -> None:
    config = RouterConfig(hot_spot_ratio=3.0, hot_spot_min_load=7)
    policy = make_policy("prefix", config)
    assert isinstance(policy, PrefixPolicy) and policy.hot_spot_ratio == 3.0
    assert make_policy(PolicyName.ROUND_ROBIN).name is PolicyName.ROUND_ROBIN
    assert make_policy("least-loaded").name is PolicyName.LEAST_LOADED
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        await LeastLoadedPolicy().choose([], ctx())


def timed(engine_id: str, step_ms: float, running: int = 0, matched: int = 0) -> Candidate:
    return Candidate(engine_id, f"http://{engine_id}:8000", matched, running, 0, 0, 0.0, step_ms)


async def test_a_slow_engine_counts_as_busy_even_when_idle() -> None:
    # b steps 10x slower: idle, it still costs (0 + 1) * 10 - 1 = 9 > a's 3 running.
    fast, slow = timed("a", 10.0, running=3), timed("b", 100.0)
    for policy in (LeastLoadedPolicy(), PrefixPolicy()):
        d = await policy.choose([slow, fast], ctx())
        assert d.candidate.engine_id == "a", policy
    # ...but not once the fast one is far busier than that.
    d = await LeastLoadedPolicy().choose([slow, timed("a", 10.0, running=12)], ctx())
    assert d.candidate.engine_id == "b"


async def test_similar_or_unknown_speeds_route_by_plain_load() -> None:
    # Within 1.25x (noise), or with a step time missing, the cost is the load itself.
    d = await LeastLoadedPolicy().choose([timed("a", 10.0, running=1), timed("b", 12.0)], ctx())
    assert d.candidate.engine_id == "b"
    d = await LeastLoadedPolicy().choose([timed("a", 10.0, running=1), timed("b", 0.0)], ctx())
    assert d.candidate.engine_id == "b"


async def test_a_cached_prefix_still_outweighs_a_somewhat_slower_engine() -> None:
    d = await PrefixPolicy().choose([timed("a", 10.0), timed("b", 15.0, matched=10)], ctx())
    assert (d.candidate.engine_id, d.reason) == ("b", "prefix-hit")
