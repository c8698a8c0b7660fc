from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis
import redis.asyncio as aioredis

from services.common.redis_index import KVIndexPublisher, KVIndexReader, connect
from tests.support.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One real redis-server for the session; tests that kill Redis start their own."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The shared server, emptied before the test."""
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest_asyncio.fixture
async def aredis(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(redis_url, timeout_s=5.0)
    yield client
    await client.aclose()


@pytest.fixture
def publisher(aredis: aioredis.Redis) -> KVIndexPublisher:
    return KVIndexPublisher(aredis)


@pytest.fixture
def reader(aredis: aioredis.Redis) -> KVIndexReader:
    return KVIndexReader(aredis)
