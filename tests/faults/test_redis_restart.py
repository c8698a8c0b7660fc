"""Redis killed and restarted under load: no request fails, and prefix routing recovers.

While Redis is down the router routes by the last load it saw; when it is back, every engine
re-announces its whole prefix cache (its heartbeat finds itself unknown), so prompts go back
to the engine holding their prefix without any new traffic teaching the index.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis

from services.protocol.redis_schema import RedisKeys
from tests.faults.helpers import router_engines, wait_for
from tests.faults.load import LoadResult, Outcome, run_load, word_prompt
from tests.support.stack import PagodaStack

PREFIXES = 6
PREFIX_WORDS = 300  # about 19 blocks of 16 tokens


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
    with PagodaStack(fast_model_dir, engines=2) as stack:
        router = stack.routers[0].url
        wait_for(lambda: len(router_engines(router)) == 2, 10, "router sees both engines")
        # Seed: each prefix's first request decides its owner engine.
        seed = asyncio.run(run_load(stack.base_url, stack.model, lambda i: _prefix(i),
                                    requests=PREFIXES, concurrency=2, max_tokens=2))
        assert seed.succeeded == PREFIXES, seed.summary()
        owner = {i: o.engine for i, o in enumerate(seed.outcomes)}
        assert len(set(owner.values())) == 2, owner  # spread over both engines
        time.sleep(1.0)  # the engines' KV events reach Redis
        before = _follow_ups(stack, 1)

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

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 30),
                         duration_s=7.0, concurrency=6, max_tokens=16, result=result),
                outage(),
            )

        asyncio.run(scenario())
        during = [o for o in result.outcomes if marks["down"] <= o.started < marks["up"]]

        # The index is rebuilt from the engines' re-announcements, before any new traffic for
        # the seeded prefixes.
        client = redis.Redis.from_url(stack.redis.url)
        keys = RedisKeys()
        blk = [keys.blocks(stack.model, stack.engine_id(i)) for i in range(2)]
        rebuilt_s = wait_for(lambda: all(client.zcard(k) >= 16 for k in blk), 10,
                             "both engines' block sets are back in Redis")
        sizes = [client.zcard(k) for k in blk]
        after = _follow_ups(stack, 2)
        print(f"\nredis restart: {result.summary()} requests_while_down={len(during)} "
              f"index_rebuilt_in={rebuilt_s:.2f}s after_up blocks={sizes}\n"
              f"  routed to the prefix's engine: before {_affinity(before, owner):.0%} "
              f"after {_affinity(after, owner):.0%}; cached follow-ups: "
              f"before {_cached(before):.0%} after {_cached(after):.0%}")

        assert result.sent > 20 and len(during) > 5
        assert not result.failed, result.summary()
        assert _affinity(before, owner) == 1.0
        assert _affinity(after, owner) == 1.0, [
            (i % PREFIXES, owner[i % PREFIXES], o.engine, o.cached_tokens)
            for i, o in enumerate(after)]
        assert _cached(after) == 1.0
