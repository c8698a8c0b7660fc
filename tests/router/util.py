"""Builders shared by the router tests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from services.protocol.block_hash import BlockHash, BlockHasher
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.messages import EngineHeartbeat, RouteRequest, RouteResponse
from services.router.config import RouterConfig
from services.router.server import MSGPACK, create_app
from tests.support.services import internal_headers

MODEL = "test-model"
BLOCK_SIZE = 16


def heartbeat(
    engine_id: str,
    *,
    model: str = MODEL,
    url: str | None = None,
    running: int = 0,
    waiting: int = 0,
    kv_usage: float = 0.0,
) -> EngineHeartbeat:
    return EngineHeartbeat(
        engine_id=engine_id,
        url=url or f"http://{engine_id}.engines:8000",
        model=model,
        block_size=BLOCK_SIZE,
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        free_blocks=100,
        total_blocks=1000,
        timestamp=time.time(),
    )


def chain(num_blocks: int, start: int = 0, model: str = MODEL) -> list[BlockHash]:
    """The real hash chain of a prompt of ``num_blocks`` full blocks; prompts with the same
    ``start`` share their prefix."""
    tokens = [start * 100_003 + i for i in range(num_blocks * BLOCK_SIZE)]
    return BlockHasher(model, BLOCK_SIZE).chain(tokens)


def stored(hashes: list[BlockHash]) -> KVEvent:
    return KVEvent(KVEventKind.STORED, tuple(hashes))


def removed(hashes: list[BlockHash]) -> KVEvent:
    return KVEvent(KVEventKind.REMOVED, tuple(hashes))


@asynccontextmanager
async def router_client(**overrides: Any) -> AsyncIterator[TestClient]:
    """An in-process router app on a loopback port, with its cleanup_ctx run; the client
    sends the internal credential."""
    config = RouterConfig(**{"host": "127.0.0.1", "port": 0, **overrides})
    async with TestClient(TestServer(create_app(config)), headers=internal_headers()) as client:
        yield client


async def route(
    client: TestClient,
    hashes: list[BlockHash] | None = None,
    *,
    model: str = MODEL,
    exclude: list[str] | None = None,
) -> RouteResponse:
    status, body = await route_raw(client, hashes, model=model, exclude=exclude)
    if status != 200:
        raise AssertionError(f"route failed: {status} {body!r}")
    return body


async def route_raw(
    client: TestClient,
    hashes: list[BlockHash] | None = None,
    *,
    model: str = MODEL,
    exclude: list[str] | None = None,
) -> tuple[int, Any]:
    hashes = hashes or []
    req = RouteRequest(model, hashes, len(hashes) * BLOCK_SIZE + 1, exclude or [])
    resp = await client.post("/route", data=req.to_msgpack(), headers={"Content-Type": MSGPACK})
    if resp.status == 200:
        return 200, RouteResponse.from_msgpack(await resp.read())
    return resp.status, await resp.json()
