"""Redis block-index lookup latency at scale: the router's one EVALSHA per request, timed from
Python against a filled index. ``benchmarks/routing_overhead.py`` reports it; the suite runs a
small instance (``tests/router/test_lookup_latency.py``)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

from services.common.redis_index import KVIndexPublisher, KVIndexReader, connect
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.messages import EngineHeartbeat
from services.protocol.redis_schema import RedisKeys


@dataclass(frozen=True, slots=True)
class LookupLatency:
    engines: int
    blocks_per_engine: int
    indexed_blocks: int
    prompt_blocks: int
    lookups: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    server_cpu_ms: float  # Redis CPU per lookup (INFO cpu delta): unaffected by other load


async def measure_lookup_latency(
    redis_url: str,
    *,
    engines: int = 128,
    blocks_per_engine: int = 8192,
    prompt_blocks: int = 128,
    lookups: int = 500,
    model: str = "bench-model",
    namespace: str = "pagoda-bench",
) -> LookupLatency:
    """Fills the index with ``engines x blocks_per_engine`` entries and times ``lookups``
    lookups of ``prompt_blocks``-block prompts, end to end from Python (one EVALSHA each).

    Workload: 16 distinct prompts, looked up in turn; engine ``e`` holds the first
    ``7e mod prompt_blocks`` blocks of prompt ``e mod 16`` plus random filler, so every prompt
    is partly cached on 1/16 of the engines (each needing a search) and absent from the rest.
    Uses its own key namespace and deletes it afterwards."""
    if engines <= 0 or blocks_per_engine <= 0 or prompt_blocks <= 0 or lookups <= 0:
        raise ValueError("engines, blocks_per_engine, prompt_blocks and lookups must be > 0")
    keys = RedisKeys(namespace)
    redis = connect(redis_url, timeout_s=30.0)
    publisher = KVIndexPublisher(redis, keys, max_blocks_per_engine=blocks_per_engine)
    reader = KVIndexReader(redis, keys, max_blocks_per_engine=blocks_per_engine)
    prompts = [[os.urandom(16) for _ in range(prompt_blocks)] for _ in range(16)]
    try:
        for e in range(engines):
            engine_id = f"engine-{e:04d}"
            await publisher.publish_heartbeat(
                EngineHeartbeat(
                    engine_id,
                    f"http://10.0.{e // 250}.{e % 250}:8000",
                    model,
                    16,
                    0,
                    0,
                    0.0,
                    100,
                    100,
                    time.time(),
                ),
                ttl_s=600,
            )
            # A prefix of one of the looked-up prompts (engine-dependent length), then filler.
            shared = prompts[e % len(prompts)][: (e * 7) % prompt_blocks]
            held = list(shared)
            held += [os.urandom(16) for _ in range(blocks_per_engine - len(held))]
            await publisher.apply_events(engine_id, model, [KVEvent(KVEventKind.STORED, held)])
        await reader.lookup(model, prompts[0])  # loads the script
        cpu_before = await _redis_cpu_s(redis)
        samples = []
        for i in range(lookups):
            start = time.perf_counter()
            await reader.lookup(model, prompts[i % len(prompts)])
            samples.append((time.perf_counter() - start) * 1000)
        server_cpu_ms = (await _redis_cpu_s(redis) - cpu_before) * 1000 / lookups
        samples.sort()
        return LookupLatency(
            engines=engines,
            blocks_per_engine=blocks_per_engine,
            indexed_blocks=engines * blocks_per_engine,
            prompt_blocks=prompt_blocks,
            lookups=lookups,
            p50_ms=samples[len(samples) // 2],
            p99_ms=samples[min(len(samples) - 1, int(len(samples) * 0.99))],
            mean_ms=statistics.fmean(samples),
            server_cpu_ms=server_cpu_ms,
        )
    finally:
        async for key in redis.scan_iter(match=f"{namespace}:*", count=1000):
            await redis.unlink(key)
        await redis.aclose()


async def _redis_cpu_s(redis: Any) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
