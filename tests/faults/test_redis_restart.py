"""Redis killed and restarted under load: no request fails, and prefix routing recovers.

While Redis is down the router routes by the last load it saw; when it is back, every engine
re-announces its whole prefix cache (its heartbeat finds itself unknown), so prompts go back
to the engine holding their prefix without any new traffic teaching the index.

The load around the outage cycles through a few prompts, so its KV working set is bounded
however many requests a machine sends: the seeded prefixes can then only leave an engine's
cache if the engine loses them, never by LRU pressure from unrelated traffic (with distinct
prompts, a machine that sends ~500 requests in the outage's 7 s evicted them, and the
follow-ups rightly went by load).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from services.protocol.redis_schema import RedisKeys
from tests.faults.helpers import (
    router_degraded,
    router_engines,
    router_idle,
    wait_for,
)
from tests.faults.load import LoadResult, Outcome, run_load, word_prompt
from tests.support.stack import PagodaStack

PREFIXES = 6
PREFIX_WORDS = 300  # about 19 blocks of 16 tokens
LOAD_PROMPTS = 16  # distinct prompts in the load around the outage
AFTER_UP = 12  # load requests started once Redis is back, before the load stops
# Blocks an engine can ever hold at once here: the seeded prefixes with the follow-ups' tails
# (2 rounds), plus the load's prompts with their outputs, each at most on both engines.
MAX_BLOCKS_USED = PREFIXES * 20 + 2 * 2 * PREFIXES * 2 + LOAD_PROMPTS * 4
NUM_BLOCKS = 512


def _prefix(k: int) -> str:
    return word_prompt(50_000 + k, PREFIX_WORDS)


def _follow_ups(stack: PagodaStack, round_no: int) -> list[Outcome]:
    """Two requests per shared prefix, each with a new tail."""
    def prompt(i: int) -> str:
        return f"{_prefix(i % PREFIXES)} question {round_no}-{i}: why?"

    res = asyncio.run(run_load(stack.base_url, stack.model, prompt, requests=2 * PREFIXES,
                               concurrency=2, max_tokens=4))
    assert res.succeeded == res.sent, res.summary()
    return res.outcomes


def _affinity(outcomes: list[Outcome], owner: dict[int, str]) -> float:
    return sum(o.engine == owner[i % PREFIXES] for i, o in enumerate(outcomes)) / len(outcomes)


def _cached(outcomes: list[Outcome]) -> float:
    return sum(o.cached_tokens >= 16 * 12 for o in outcomes) / len(outcomes)


def test_redis_restart_mid_load(fast_model_dir: Path) -> None:
    assert MAX_BLOCKS_USED < NUM_BLOCKS  # nothing the test relies on can be evicted
    with PagodaStack(fast_model_dir, engines=2, num_blocks=NUM_BLOCKS) as stack:
        router = stack.routers[0].url
        wait_for(lambda: len(router_engines(router)) == 2, 10, "router sees both engines")
        # Seed: each prefix's first request decides its owner engine.
        seed = asyncio.run(run_load(stack.base_url, stack.model, lambda i: _prefix(i),
                                    requests=PREFIXES, concurrency=2, max_tokens=2))
        assert seed.succeeded == PREFIXES, seed.summary()
        owner = {i: o.engine for i, o in enumerate(seed.outcomes)}
        assert len(set(owner.values())) == 2, owner  # spread over both engines
        client = redis.Redis.from_url(stack.redis.url)
        keys = RedisKeys()
        blk = [keys.blocks(stack.model, stack.engine_id(i)) for i in range(2)]
        held = {e: 16 * sum(o == e for o in owner.values()) for e in set(owner.values())}
        wait_for(lambda: all(client.zcard(keys.blocks(stack.model, e)) >= n
                             for e, n in held.items()), 10, "the seeded prefixes are indexed")
        before = _follow_ups(stack, 1)
        # What the index holds before the outage: the prefixes and the follow-ups' tails.
        indexed = [client.zrange(k, 0, -1) for k in blk]

        # Load with other prompts while Redis dies and comes back.
        result = LoadResult()
        marks: dict[str, float] = {}

        async def outage() -> None:
            await asyncio.sleep(1.0)
            await asyncio.to_thread(stack.redis.stop)
            marks["down"] = time.monotonic()
            await asyncio.sleep(3.0)
            await asyncio.to_thread(stack.redis.start)
            marks["up"] = time.monotonic()

        def enough_after_up() -> bool:
            up = marks.get("up")
            return up is not None and sum(o.started >= up for o in result.outcomes) >= AFTER_UP

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i % LOAD_PROMPTS, 30),
                         duration_s=60.0, until=enough_after_up, concurrency=6, max_tokens=16,
                         result=result),
                outage(),
            )

        asyncio.run(scenario())
        during = [o for o in result.outcomes if marks["down"] <= o.started < marks["up"]]

        # The index is rebuilt from the engines' re-announcements, before any new traffic for
        # the seeded prefixes: every entry it had before the outage is back. Nothing can have
        # been evicted (MAX_BLOCKS_USED), so an entry still missing would be lost by the index.
        rebuilt_s = time.monotonic() - marks["up"] + wait_for(
            lambda: all(None not in client.zmscore(k, members)
                        for k, members in zip(blk, indexed, strict=True)),
            10, "every entry indexed before the outage is back")
        # The router retries Redis a moment after its last error; until then it routes by load.
        # And the follow-ups, like those before the outage, meet idle engines: the load's
        # last requests must not trip the hot-spot guard.
        wait_for(lambda: not router_degraded(router) and router_idle(router), 10,
                 "the router reads Redis again and sees idle engines")
        sizes = [client.zcard(k) for k in blk]
        after = _follow_ups(stack, 2)
        print(f"\nredis restart: {result.summary()} requests_while_down={len(during)} "
              f"index_rebuilt_within={rebuilt_s:.2f}s_of_redis_up blocks={sizes}\n"
              f"  routed to the prefix's engine: before {_affinity(before, owner):.0%} "
              f"after {_affinity(after, owner):.0%}; cached follow-ups: "
              f"before {_cached(before):.0%} after {_cached(after):.0%}")

        assert len(during) > 5 and enough_after_up()
        assert not result.failed, result.summary()
        assert _affinity(before, owner) == 1.0
        assert _affinity(after, owner) == 1.0, [
            (i % PREFIXES, owner[i % PREFIXES], o.engine, o.cached_tokens)
            for i, o in enumerate(after)]
        assert _cached(after) == 1.0
