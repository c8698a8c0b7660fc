"""Redis goes away: the router keeps routing by the last known load, and says so."""

from __future__ import annotations

import asyncio

import pytest

from services.common.redis_index import KVIndexPublisher, connect
from tests.router.util import MODEL, chain, heartbeat, route, router_client, stored
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.asyncio


async def test_routing_continues_by_load_when_redis_dies() -> None:
    with RedisServer() as server:
        client = connect(server.url)
        publisher = KVIndexPublisher(client)
        prompt = chain(4)
        await publisher.publish_heartbeat(heartbeat("a", running=1))
        await publisher.publish_heartbeat(heartbeat("b", running=0))
        await publisher.publish_heartbeat(heartbeat("c", running=4))
        await publisher.apply_events("a", MODEL, [stored(prompt)])
        await client.aclose()

        async with router_client(redis_url=server.url, redis_retry_s=0.2) as router:
            assert (await route(router, prompt)).reason == "prefix-hit"

            server.stop()
            picks = []
            for _ in range(4):
                resp = await route(router, prompt)
                assert resp.reason == "degraded" and resp.matched_blocks == 0
                picks.append(resp.engine_id)
            # By the cached load, spread by what this router sent since (pending).
            assert picks == ["b", "a", "b", "a"]
            health = await (await router.get("/health")).json()
            assert health["redis"] == "unavailable"
            engines = await (await router.get("/engines")).json()
            assert engines["degraded"] is True and len(engines["engines"]) == 3
            metrics = await (await router.get("/metrics")).text()
            assert 'pagoda_router_redis_errors_total{op="lookup"}' in metrics
            assert 'pagoda_router_decisions_total{policy="prefix",reason="degraded"} 4.0' in metrics

            # Redis is back (empty, as after a restart): normal routing resumes by itself.
            server.start()
            client = connect(server.url)
            await KVIndexPublisher(client).publish_heartbeat(heartbeat("b"))
            await client.aclose()
            await asyncio.sleep(0.25)
            resp = await route(router, prompt)
            assert (resp.engine_id, resp.reason) == ("b", "least-loaded")


async def test_router_started_while_redis_is_down_uses_discovered_engines() -> None:
    server = RedisServer()  # never started: nothing listens on its port
    engines = ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    async with router_client(redis_url=server.url, engines=engines) as router:
        picks = [(await route(router, chain(2))) for _ in range(4)]
        assert {p.reason for p in picks} == {"degraded"}
        assert [p.url for p in picks] == [engines[0], engines[1], engines[0], engines[1]]
        assert (await router.get("/ready")).status == 200
