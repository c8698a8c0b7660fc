"""The router's per-model demand metrics (services/router/demand.py), against a real Redis:
engines' running and waiting, routed-but-unreported requests, requests held at gateways for
want of an engine, and arrivals (a counter and a rate that shows at the first request)."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp.test_utils import TestClient

from services.common.redis_index import KVIndexPublisher
from services.protocol.messages import RouteRequest
from services.router.demand import HELD_TTL_S, ArrivalRate
from services.router.server import MSGPACK
from tests.router.util import MODEL, chain, heartbeat, router_client

pytestmark = pytest.mark.asyncio


async def ask(client: TestClient, rid: str, waited_s: float = 0.0, model: str = MODEL) -> int:
    hashes = chain(2)
    req = RouteRequest(model, hashes, 2 * 16 + 1, [], rid, waited_s)
    resp = await client.post("/route", data=req.to_msgpack(), headers={"Content-Type": MSGPACK})
    await resp.read()
    return resp.status


async def metrics(client: TestClient, model: str = MODEL) -> dict[str, float]:
    text = await (await client.get("/metrics")).text()
    out = {}
    for name, value in re.findall(
        rf'^pagoda_router_(\w+)\{{model="{re.escape(model)}"\}} (\S+)$', text, re.MULTILINE
    ):
        out[name] = float(value)
    return out


async def test_held_requests_count_until_they_get_an_engine(redis_url: str,
                                                            publisher: KVIndexPublisher) -> None:
    async with router_client(redis_url=redis_url) as client:
        # Scale from zero: two requests arrive, no engine is live; the gateway holds them.
        assert await ask(client, "r1") == 503
        assert await ask(client, "r2") == 503
        m = await metrics(client)
        assert m["arrivals_total"] == 2 and m["arrival_rate"] > 0
        assert m["requests_held"] == 2 and m["requests_waiting"] == 2
        assert m["requests_in_flight"] == 2 and m["requests_running"] == 0
        assert await ask(client, "r1", waited_s=0.5) == 503  # asks again: not a new arrival
        assert (await metrics(client))["arrivals_total"] == 2
        # An engine starts; the held requests get it and stop counting as held.
        await publisher.publish_heartbeat(heartbeat("e1"))
        assert await ask(client, "r1", waited_s=1.0) == 200
        m = await metrics(client)
        assert m["requests_held"] == 1  # r2 has not asked again yet
        assert m["requests_waiting"] == 2  # r1 is now pending on e1 (routed, not yet reported)
        # A held request whose gateway gave up stops counting a few poll intervals later.
        await asyncio.sleep(HELD_TTL_S + 0.2)
        m = await metrics(client)
        assert m["requests_held"] == 0 and m["requests_waiting"] == 1
        assert m["arrivals_total"] == 2


async def test_waiting_and_running_follow_heartbeats_and_routed_requests(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    async with router_client(redis_url=redis_url) as client:
        await publisher.publish_heartbeat(heartbeat("a", running=3, waiting=2))
        await publisher.publish_heartbeat(heartbeat("b", running=1, waiting=0))
        m = await metrics(client)
        assert (m["requests_running"], m["requests_waiting"], m["requests_in_flight"]) == (4, 2, 6)
        assert m["requests_held"] == 0
        for i in range(3):  # routed: pending on an engine until its next heartbeat
            assert await ask(client, f"r{i}") == 200
        m = await metrics(client)
        assert (m["requests_waiting"], m["requests_in_flight"]) == (5, 9)
        assert m["arrivals_total"] == 3
        # The engines' next heartbeats report them (running now), and reset the pending counts.
        await publisher.publish_heartbeat(heartbeat("a", running=5, waiting=2))
        await publisher.publish_heartbeat(heartbeat("b", running=2, waiting=0))
        m = await metrics(client)
        assert (m["requests_running"], m["requests_waiting"], m["requests_in_flight"]) == (7, 2, 9)
        # Another model's series are its own.
        assert await ask(client, "x", model="other") == 503
        other = await metrics(client, "other")
        assert other["requests_held"] == 1 and other["arrivals_total"] == 1


async def test_arrival_rate_window() -> None:
    rate = ArrivalRate(window_s=10.0)
    for t in (100.0, 100.5, 101.2, 105.0):
        rate.add(t)
    assert rate.per_second(105.0) == pytest.approx(0.4)
    assert rate.per_second(110.9) == pytest.approx(0.2)  # the second 100 has left the window
    assert rate.per_second(120.0) == 0.0


async def test_a_model_whose_last_engine_left_has_no_engine_at_once(
    redis_url: str, publisher: KVIndexPublisher
) -> None:
    """Scaled to zero: the last engine leaves gracefully, and the next request is told there is
    no engine (so the gateway holds it), not routed to the engine that left as if Redis had
    lost its data."""
    async with router_client(redis_url=redis_url) as client:
        await publisher.publish_heartbeat(heartbeat("last"))
        assert await ask(client, "r1") == 200
        await publisher.remove_engine("last", MODEL)
        assert await ask(client, "r2") == 503
        assert (await metrics(client))["requests_held"] == 1
