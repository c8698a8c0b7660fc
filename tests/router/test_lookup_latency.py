"""The lookup benchmark helper, at a small scale (the 1M-block figures come from running it at
full scale: ``measure_lookup_latency(url, engines=128, blocks_per_engine=8192)``)."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from benchmarks.lookup_latency import measure_lookup_latency

pytestmark = pytest.mark.asyncio


async def test_measure_lookup_latency_small(redis_url: str, aredis: aioredis.Redis) -> None:
    result = await measure_lookup_latency(
        redis_url, engines=16, blocks_per_engine=512, prompt_blocks=64, lookups=50
    )
    assert result.indexed_blocks == 16 * 512 and result.lookups == 50
    assert 0 < result.p50_ms <= result.p99_ms
    assert await aredis.dbsize() == 0  # cleans up after itself
    with pytest.raises(ValueError):
        await measure_lookup_latency(redis_url, engines=0)
