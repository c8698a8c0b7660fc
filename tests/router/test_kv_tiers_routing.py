"""Routing on every KV tier: the index keeps each engine's pool and host tier apart (events'
``medium``), scores the longest prefix with per-tier weights, and a prefix only the shared
store holds makes the engines equal (load decides)."""

from __future__ import annotations

import pytest

from services.common.redis_index import KVIndexPublisher, KVIndexReader
from services.protocol.kv_events import KVEvent, KVEventKind, Medium
from services.router.policies import Candidate, tiered_match
from tests.router.util import MODEL, chain, heartbeat, route, router_client


def _stored(hashes, medium: Medium) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tuple(hashes), medium=medium)


@pytest.mark.asyncio
async def test_the_index_keeps_each_tier_and_the_router_weighs_them(
    redis_url: str, publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    prompt = chain(10)
    for engine_id in ("a", "b", "c"):
        await publisher.publish_heartbeat(heartbeat(engine_id))
    # a: blocks 0-2 in its pool, 3-8 in host memory; b: blocks 0-5 in its pool; c: nothing.
    await publisher.apply_events("a", MODEL, [_stored(prompt[:3], Medium.GPU),
                                              _stored(prompt[:9], Medium.CPU)])
    await publisher.apply_events("b", MODEL, [_stored(prompt[:6], Medium.GPU)])
    found = {m.heartbeat.engine_id: m for m in (await reader.lookup(MODEL, prompt)).engines}
    assert (found["a"].matched_blocks, found["a"].reach_blocks) == (3, 9)
    assert (found["b"].matched_blocks, found["b"].reach_blocks) == (6, 6)
    assert (found["c"].matched_blocks, found["c"].reach_blocks) == (0, 0)
    async with router_client(redis_url=redis_url) as client:
        resp = await route(client, prompt)  # a: 3 + 0.8 * 6 = 7.8 > b: 6
        assert (resp.engine_id, resp.reason) == ("a", "prefix-hit")
    # Evicted from a's host tier (REMOVED, medium CPU): b's pool wins now.
    await publisher.apply_events("a", MODEL, [KVEvent(KVEventKind.REMOVED, tuple(prompt[3:9]),
                                                      medium=Medium.CPU)])
    async with router_client(redis_url=redis_url) as client:
        assert (await route(client, prompt)).engine_id == "b"
    # "cleared" (an engine re-announcing) empties its pool and its host tier.
    await publisher.apply_events("a", MODEL, [_stored(prompt[:9], Medium.CPU),
                                              KVEvent(KVEventKind.CLEARED)])
    found = {m.heartbeat.engine_id: m for m in (await reader.lookup(MODEL, prompt)).engines}
    assert (found["a"].matched_blocks, found["a"].reach_blocks) == (0, 0)


@pytest.mark.asyncio
async def test_a_prefix_only_in_the_shared_store_leaves_the_choice_to_load(
    redis_url: str, publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    prompt = chain(8, start=3)
    await publisher.publish_heartbeat(heartbeat("a", running=4))
    await publisher.publish_heartbeat(heartbeat("b", running=1))
    # Engine a wrote the prefix to the shared store; neither engine holds it now.
    await publisher.apply_events("a", MODEL, [_stored(prompt, Medium.SHARED)])
    result = await reader.lookup(MODEL, prompt)
    assert result.shared_blocks == 8
    assert {m.heartbeat.engine_id: m.matched_blocks for m in result.engines} == {"a": 0, "b": 0}
    async with router_client(redis_url=redis_url) as client:
        assert (await route(client, prompt)).engine_id == "b"  # the less loaded one


def test_tiered_match_weights_pool_host_and_shared_blocks() -> None:
    def cand(pool: int, reach: int, shared: int) -> Candidate:
        return Candidate("e", "u", pool, 0, 0, 0, 0.0, reach_blocks=reach, shared_blocks=shared)

    assert tiered_match(cand(4, 4, 0)) == 4.0
    assert tiered_match(cand(0, 5, 0)) == pytest.approx(4.0)
    assert tiered_match(cand(2, 6, 10)) == pytest.approx(2 + 0.8 * 4 + 0.5 * 4)
    assert tiered_match(cand(3, 0, 2)) == 3.0  # shorter lower tiers add nothing
