"""The Redis block index: events, TTLs, bounds, prefix matching, one-round-trip lookups."""

from __future__ import annotations

import asyncio
import math

import pytest
import redis.asyncio as aioredis
from redis.asyncio.connection import Connection

from services.common.redis_index import KVIndexPublisher, KVIndexReader, connect, redact_url
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.redis_schema import RedisKeys
from tests.router.util import MODEL, chain, heartbeat, removed, stored
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.asyncio


async def matches(reader: KVIndexReader, hashes: list[bytes]) -> dict[str, int]:
    result = await reader.lookup(MODEL, hashes)
    return {m.heartbeat.engine_id: m.matched_blocks for m in result.engines}


async def test_stored_and_removed_events(
    publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    prompt = chain(8)
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.publish_heartbeat(heartbeat("b"))
    assert await publisher.apply_events("a", MODEL, [stored(prompt[:5])]) == 5
    await publisher.apply_events("b", MODEL, [stored(prompt)])
    assert await matches(reader, prompt) == {"a": 5, "b": 8}

    # The tail goes first on eviction; the prefix stays matched.
    assert await publisher.apply_events("b", MODEL, [removed(prompt[6:])]) == 6
    assert await matches(reader, prompt) == {"a": 5, "b": 6}
    # Events apply in order within one call.
    await publisher.apply_events("a", MODEL, [removed(prompt[:5]), stored(prompt[:2])])
    assert await matches(reader, prompt) == {"a": 2, "b": 6}
    await publisher.apply_events("b", MODEL, [KVEvent(KVEventKind.CLEARED)])
    assert await matches(reader, prompt) == {"a": 2, "b": 0}


async def test_events_are_the_engines_own_type(
    publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    prompt = chain(3)
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.apply_events("a", MODEL, [KVEvent(KVEventKind.STORED, tuple(prompt[:2]))])
    await publisher.apply_events("a", MODEL, [stored(prompt[2:])])
    assert await matches(reader, prompt) == {"a": 3}
    with pytest.raises(ValueError, match="16 raw bytes"):
        await publisher.apply_events("a", MODEL, [KVEvent(KVEventKind.STORED, (b"x" * 15,))])


async def test_prefix_closed_matching(publisher: KVIndexPublisher, reader: KVIndexReader) -> None:
    prompt = chain(64)
    await publisher.publish_heartbeat(heartbeat("a"))
    for held in (0, 1, 2, 31, 32, 33, 63, 64):
        await publisher.apply_events(
            "a", MODEL, [KVEvent(KVEventKind.CLEARED), stored(prompt[:held])]
        )
        assert await matches(reader, prompt) == {"a": held}
    # Another prompt sharing the first 10 blocks only.
    other = prompt[:10] + chain(54, start=9)
    assert await matches(reader, other) == {"a": 10}
    assert await matches(reader, []) == {"a": 0}


async def test_entries_expire_and_the_index_stays_bounded(aredis: aioredis.Redis) -> None:
    publisher = KVIndexPublisher(aredis, block_ttl_s=1.0, max_blocks_per_engine=100)
    reader = KVIndexReader(aredis, max_blocks_per_engine=100)
    keys = RedisKeys()
    await publisher.publish_heartbeat(heartbeat("a"))
    # The cap: the oldest entries go first.
    first, second = chain(80), chain(80, start=1)
    await publisher.apply_events("a", MODEL, [stored(first)])
    await asyncio.sleep(0.01)
    assert await publisher.apply_events("a", MODEL, [stored(second)]) == 100
    assert await aredis.zcard(keys.blocks(MODEL, "a")) == 100
    assert await matches(reader, second) == {"a": 80}
    assert await matches(reader, first) == {"a": 0}  # its first blocks were trimmed

    # The TTL: entries (and the key) disappear without any event.
    pttl = await aredis.pttl(keys.blocks(MODEL, "a"))
    assert 0 < pttl <= 1000
    await publisher.publish_heartbeat(heartbeat("a"))
    await asyncio.sleep(1.05)
    assert await matches(reader, second) == {"a": 0}
    assert await aredis.exists(keys.blocks(MODEL, "a")) == 0


async def test_large_event_batches_are_chunked(
    publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    prompt = chain(5000)
    await publisher.publish_heartbeat(heartbeat("a"))
    events = [stored([h]) for h in prompt] + [removed(prompt[4000:])]
    assert await publisher.apply_events("a", MODEL, events) == 4000
    assert await matches(reader, prompt) == {"a": 4000}


async def test_dead_engine_is_not_live(publisher: KVIndexPublisher, reader: KVIndexReader) -> None:
    prompt = chain(4)
    await publisher.publish_heartbeat(heartbeat("a"), ttl_s=0.5)
    await publisher.publish_heartbeat(heartbeat("b"), ttl_s=30)
    await publisher.apply_events("a", MODEL, [stored(prompt)])
    assert await matches(reader, prompt) == {"a": 4, "b": 0}
    await asyncio.sleep(0.55)
    result = await reader.lookup(MODEL, prompt)
    assert [m.heartbeat.engine_id for m in result.engines] == ["b"]
    assert result.dead == ["a"]
    # A router's write-back forgets it from the engine set.
    await reader.mark(MODEL, "b", prompt, forget=result.dead)
    assert (await reader.lookup(MODEL, prompt)).dead == []
    # Graceful shutdown removes an engine at once; it stays listed, dead, until forgotten.
    await publisher.remove_engine("b", MODEL)
    result = await reader.lookup(MODEL, prompt)
    assert (result.engines, result.dead) == ([], ["b"])


async def test_mark_is_provisional_and_never_shortens_stored_entries(
    aredis: aioredis.Redis,
) -> None:
    publisher = KVIndexPublisher(aredis, block_ttl_s=30)
    reader = KVIndexReader(aredis)
    keys = RedisKeys()
    prompt = chain(6)
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.apply_events("a", MODEL, [stored(prompt[:3])])
    assert await reader.mark(MODEL, "a", prompt, ttl_s=0.5, pending_ttl_s=5) == 1
    assert await reader.mark(MODEL, "a", [], ttl_s=0.5) == 2
    assert await matches(reader, prompt) == {"a": 6}
    assert (await reader.lookup(MODEL, [])).engines[0].pending == 2
    await asyncio.sleep(0.55)
    # The provisional tail expired; what the engine stored did not; the key keeps its TTL.
    assert await matches(reader, prompt) == {"a": 3}
    assert await aredis.pttl(keys.blocks(MODEL, "a")) > 20_000
    # The engine's next heartbeat resets the pending count.
    await publisher.publish_heartbeat(heartbeat("a", waiting=2))
    assert (await reader.lookup(MODEL, [])).engines[0].pending == 0


class CountingConnection(Connection):
    """Counts requests written to the socket: one per round trip (a pipeline is one)."""

    writes = 0

    async def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        CountingConnection.writes += 1
        return await super().send_packed_command(command, check_health)


async def test_lookup_is_one_round_trip_however_long_the_prompt(
    redis_url: str, publisher: KVIndexPublisher, aredis: aioredis.Redis
) -> None:
    for e in range(8):
        await publisher.publish_heartbeat(heartbeat(f"e{e}"))
        await publisher.apply_events(f"e{e}", MODEL, [stored(chain(e * 100))])
    counted = aioredis.from_url(redis_url, connection_class=CountingConnection)
    reader = KVIndexReader(counted)
    try:
        await reader.lookup(MODEL, [])  # loads the script into the server once
        for blocks in (1, 10, 1000, 5000):
            before_writes = CountingConnection.writes
            before = await _command_calls(aredis)
            result = await reader.lookup(MODEL, chain(blocks))
            assert CountingConnection.writes - before_writes == 1
            after = await _command_calls(aredis)
            # Server side: exactly one command arrived from a client (the EVALSHA); the block
            # and heartbeat reads ran inside it.
            client_calls = {k: after[k] - before.get(k, 0) for k in after}
            assert client_calls.get("evalsha") == 1
            # Per engine: one ZMSCORE of the first and last block, then a 4-ary search.
            assert client_calls.get("zmscore", 0) <= 8 * (1 + math.ceil(math.log(blocks + 1, 4)))
            assert {m.heartbeat.engine_id: m.matched_blocks for m in result.engines} == {
                f"e{e}": min(blocks, e * 100) for e in range(8)
            }
    finally:
        await counted.aclose()


async def _command_calls(client: aioredis.Redis) -> dict[str, int]:
    stats = await client.info("commandstats")
    # INFO itself is counted too: ignore it (it comes from the measuring client).
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if "info" not in k}


async def test_password_urls() -> None:
    with RedisServer(password="s3cret") as server:
        assert "s3cret" not in redact_url(server.url)
        client = connect(server.url)
        try:
            await KVIndexPublisher(client).publish_heartbeat(heartbeat("a"))
            result = await KVIndexReader(client).lookup(MODEL, chain(2))
            assert [m.heartbeat.engine_id for m in result.engines] == ["a"]
        finally:
            await client.aclose()
        wrong = connect(server.url.replace("s3cret", "wrong"))
        try:
            with pytest.raises(Exception, match="(?i)auth|password|WRONGPASS"):
                await wrong.ping()
        finally:
            await wrong.aclose()


async def test_key_layout() -> None:
    keys = RedisKeys("pagoda")
    assert keys.heartbeat("llama", "e1") == "pagoda:{llama}:hb:e1"
    assert keys.blocks("org/model:v1", "e1") == "pagoda:{org/model:v1}:blk:e1"
    # Braces would break the cluster hash tag: encoded.
    assert keys.engines("a{b}") == "pagoda:{a%7Bb%7D}:engines"
    with pytest.raises(ValueError):
        RedisKeys("bad:ns")
    with pytest.raises(ValueError):
        connect("http://localhost")


async def test_search_finds_every_prefix_length(
    publisher: KVIndexPublisher, reader: KVIndexReader
) -> None:
    """The 4-ary search against a linear walk, for every held length of prompts of several
    sizes (prefix-closed holdings), several engines at once."""
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.publish_heartbeat(heartbeat("b"))
    for n in (1, 2, 3, 5, 17, 64, 100):
        prompt = chain(n, start=n)
        for held in sorted({0, 1, n // 3, n // 2, n - 1, n} | set(range(0, n + 1, max(1, n // 9)))):
            await publisher.apply_events(
                "a", MODEL, [KVEvent(KVEventKind.CLEARED), stored(prompt[:held])]
            )
            await publisher.apply_events(
                "b", MODEL, [KVEvent(KVEventKind.CLEARED), stored(prompt[: n - held])]
            )
            assert await matches(reader, prompt) == {"a": held, "b": n - held}, (n, held)


async def test_connect_accepts_tls_and_passwords() -> None:
    client = connect("rediss://user:pw@redis.example:6380/2")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("user", "pw", 2)
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert (
        redact_url("rediss://user:pw@redis.example:6380/2")
        == "rediss://user:***@redis.example:6380/2"
    )
    await client.aclose()
