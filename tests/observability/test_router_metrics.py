"""The router's live-engines gauge follows heartbeats even for a model without traffic: the
gateways' ``/engines`` polls refresh it, not only ``/route`` calls."""

from __future__ import annotations

import asyncio
import re

import pytest
from aiohttp.test_utils import TestClient

from services.common.redis_index import KVIndexPublisher, connect
from tests.router.util import MODEL, heartbeat, router_client
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.asyncio


async def live_engines(client: TestClient) -> float | None:
    text = await (await client.get("/metrics")).text()
    m = re.search(rf'^pagoda_router_live_engines{{model="{MODEL}"}} (\S+)$', text, re.MULTILINE)
    return float(m.group(1)) if m else None


async def test_live_engines_gauge_is_refreshed_by_engines_polls(
    redis_server: RedisServer,
) -> None:
    aredis = connect(redis_server.url, timeout_s=5.0)
    await aredis.flushall()
    publisher = KVIndexPublisher(aredis)
    try:
        async with router_client(redis_url=redis_server.url) as client:
            await publisher.publish_heartbeat(heartbeat("a"))
            await publisher.publish_heartbeat(heartbeat("b"), ttl_s=0.3)
            assert (await client.get("/engines")).status == 200
            assert await live_engines(client) == 2
            await asyncio.sleep(0.5)  # b's heartbeat expires; no request is routed meanwhile
            assert (await client.get("/engines")).status == 200
            assert await live_engines(client) == 1
            assert (await client.get("/engines?model=made-up")).status == 200
            text = await (await client.get("/metrics")).text()
            assert "made-up" not in text  # no label for a name nobody serves
    finally:
        await aredis.aclose()
