"""The router's HTTP API, in process, against a real Redis."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import redis

from services.common.redis_index import KVIndexPublisher
from tests.router.util import (
    MODEL,
    chain,
    heartbeat,
    route,
    route_raw,
    router_client,
    stored,
)

pytestmark = pytest.mark.asyncio


async def test_routes_to_the_engine_holding_the_prefix(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    prompt = chain(10)
    for engine_id in ("a", "b", "c"):
        await publisher.publish_heartbeat(heartbeat(engine_id))
    await publisher.apply_events("b", MODEL, [stored(prompt[:7])])
    async with router_client(redis_url=redis_url) as client:
        resp = await route(client, prompt)
        assert (resp.engine_id, resp.url) == ("b", "http://b.engines:8000")
        assert (resp.matched_blocks, resp.reason, resp.policy) == (7, "prefix-hit", "prefix")
        metrics = await (await client.get("/metrics")).text()
        assert 'pagoda_router_decisions_total{policy="prefix",reason="prefix-hit"} 1.0' in metrics
        assert "pagoda_router_lookup_seconds_count 1.0" in metrics
        assert 'pagoda_router_live_engines{model="test-model"} 3.0' in metrics


async def test_write_back_makes_siblings_land_together(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    for engine_id in ("a", "b", "c"):
        await publisher.publish_heartbeat(heartbeat(engine_id))
    system_prompt = chain(6)
    first = system_prompt + chain(2, start=1)
    sibling = system_prompt + chain(3, start=2)
    unrelated = chain(8, start=3)
    async with router_client(redis_url=redis_url) as client:
        r1 = await route(client, first)
        assert r1.matched_blocks == 0
        # The first choice is pending on r1's engine, so unrelated work goes elsewhere...
        r2 = await route(client, unrelated)
        assert r2.engine_id != r1.engine_id
        # ...while the sibling follows the shared prefix before any engine reported a KV event.
        r3 = await route(client, sibling)
        assert (r3.engine_id, r3.matched_blocks, r3.reason) == (r1.engine_id, 6, "prefix-hit")


async def test_replicas_agree(redis_url: str, publisher: KVIndexPublisher) -> None:
    prompts = [chain(8, start=i % 3) + chain(2, start=10 + i) for i in range(9)]

    async def setup() -> None:
        with redis.Redis.from_url(redis_url) as sync_client:
            sync_client.flushall()
        for engine_id, running in (("a", 1), ("b", 0), ("c", 2), ("d", 0)):
            await publisher.publish_heartbeat(heartbeat(engine_id, running=running))
        await publisher.apply_events("c", MODEL, [stored(chain(8, start=1))])

    for policy in ("prefix", "round-robin", "least-loaded"):
        async with (
            router_client(redis_url=redis_url, policy=policy) as one,
            router_client(redis_url=redis_url, policy=policy) as two,
        ):
            await setup()
            alone = [(await route(one, p)).engine_id for p in prompts]
            await setup()
            shared = [(await route((one, two)[i % 2], p)).engine_id for i, p in enumerate(prompts)]
        assert alone == shared, policy
        if policy == "round-robin":
            assert alone == ["a", "b", "c", "d", "a", "b", "c", "d", "a"]


async def test_dead_engine_gets_no_traffic(redis_url: str, publisher: KVIndexPublisher) -> None:
    prompt = chain(5)
    await publisher.publish_heartbeat(heartbeat("alive", running=5))
    async with router_client(redis_url=redis_url) as client:
        await publisher.publish_heartbeat(heartbeat("dying"), ttl_s=0.5)
        await publisher.apply_events("dying", MODEL, [stored(prompt)])
        assert (await route(client, prompt)).engine_id == "dying"
        await asyncio.sleep(0.55)
        for _ in range(3):
            assert (await route(client, prompt)).engine_id == "alive"
        engines = (await (await client.get("/engines")).json())["engines"]
        assert [e["engine_id"] for e in engines] == ["alive"]


async def test_exclude_and_no_engine_errors(redis_url: str, publisher: KVIndexPublisher) -> None:
    prompt = chain(3)
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.publish_heartbeat(heartbeat("b", url="http://10.0.0.2:8000"))
    await publisher.apply_events("a", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url) as client:
        assert (await route(client, prompt, exclude=["a"])).engine_id == "b"
        assert (await route(client, prompt, exclude=["http://10.0.0.2:8000/"])).engine_id == "a"
        status, body = await route_raw(client, prompt, exclude=["a", "b"])
        assert status == 409 and "excluded" in body["error"]["message"]
        status, body = await route_raw(client, prompt, model="unknown-model")
        assert status == 503 and body["error"]["type"] == "no_engine"
        bad = await client.post("/route", data=b"\x93garbage")
        assert bad.status == 400 and "RouteRequest" in (await bad.json())["error"]["message"]


async def test_a_failed_engine_is_avoided_until_it_heartbeats_again(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    """After a gateway excludes an engine (it failed a request), every request avoids it,
    even one whose prefix only it holds, until it publishes a newer heartbeat: then it is
    back at once, not when the suspicion times out."""
    prompt = chain(4)
    hb_a = heartbeat("a")
    await publisher.publish_heartbeat(hb_a)
    await publisher.publish_heartbeat(heartbeat("b"))
    await publisher.apply_events("a", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url) as client:
        assert (await route(client, prompt)).engine_id == "a"
        assert (await route(client, prompt, exclude=["a"])).engine_id == "b"
        for _ in range(3):  # the same heartbeat: still suspect
            assert (await route(client, prompt)).engine_id == "b"
        await publisher.publish_heartbeat(replace(hb_a, timestamp=hb_a.timestamp + 0.5))
        resp = await route(client, prompt)
        assert (resp.engine_id, resp.reason) == ("a", "prefix-hit")


async def test_static_discovery_limits_the_engines(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    prompt = chain(3)
    await publisher.publish_heartbeat(heartbeat("listed", url="http://10.0.0.1:8000"))
    await publisher.publish_heartbeat(heartbeat("stray", url="http://10.0.0.9:8000"))
    await publisher.apply_events("stray", MODEL, [stored(prompt)])
    async with router_client(redis_url=redis_url, engines=("HTTP://10.0.0.1:8000/",)) as client:
        for _ in range(3):
            assert (await route(client, prompt)).engine_id == "listed"
        engines = (await (await client.get("/engines")).json())["engines"]
        assert {e["engine_id"]: e["discovered"] for e in engines} == {
            "listed": True,
            "stray": False,
        }


async def test_health_ready_engines(redis_url: str, publisher: KVIndexPublisher) -> None:
    await publisher.publish_heartbeat(heartbeat("a", running=2, waiting=1, kv_usage=0.25))
    await publisher.publish_heartbeat(heartbeat("x", model="other-model"))
    async with router_client(redis_url=redis_url) as client:
        health = await (await client.get("/health")).json()
        assert health["status"] == "ok" and health["redis"] == "ok"
        assert (await client.get("/ready")).status == 200
        body = await (await client.get("/engines")).json()
        assert body["degraded"] is False
        assert {(e["model"], e["engine_id"]) for e in body["engines"]} == {
            (MODEL, "a"),
            ("other-model", "x"),
        }
        one = await (await client.get("/engines", params={"model": MODEL})).json()
        (row,) = one["engines"]
        assert (row["running"], row["waiting"], row["kv_usage"]) == (2, 1, 0.25)
