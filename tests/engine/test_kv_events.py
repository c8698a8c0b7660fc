"""KV events exist only for a consumer: the offline ``LLM`` keeps none; the server's queue of
them is bounded, and its overflow is a resync (the core re-announces its cache), logged
once, never a silent loss. On Redis's channel they name blocks by hash only, unless the
operator asks for token ids (``--kv-events-token-ids``)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import msgpack
import pytest
import redis

from services.engine import LLM, SamplingParams
from services.engine.config import EngineConfig
from services.engine.serving.engine_thread import EngineThread
from services.engine.serving.kv_event_queue import KVEventQueue
from services.engine.serving.redis_publisher import EnginePublisher
from services.engine.serving.server_config import ServerConfig
from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.redis_schema import RedisKeys
from tests.support.redis_server import RedisServer

_QUEUE_LOGGER = "services.engine.serving.kv_event_queue"


def test_an_offline_llm_keeps_no_kv_events(fast_model_dir: Path) -> None:
    """Prefix hits, evictions and all: nothing accumulates that nobody would ever drain."""
    llm = LLM(str(fast_model_dir), num_blocks=12, max_num_seqs=4)
    try:
        shared = list(range(1000, 1064))  # four full blocks of 16
        prompts = [shared + [2000 + i] for i in range(3)] + [list(range(3000, 3100))]
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
        assert any(out.num_cached_tokens for out in outs)  # the cache works without events
        bm = llm.engine.block_manager
        assert not bm.record_events and bm._events == [] and llm.engine.take_kv_events() == []
    finally:
        llm.engine.close()


def _event(n: int) -> KVEvent:
    return KVEvent(KVEventKind.STORED, (BlockHash(n.to_bytes(16, "little")),), 16)


def test_an_overflow_empties_the_queue_asks_for_a_resync_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    resyncs: list[int] = []
    queue = KVEventQueue(lambda: resyncs.append(len(queue)), max_events=4)
    caplog.set_level(logging.DEBUG, _QUEUE_LOGGER)
    queue.extend([_event(0), _event(1)])
    queue.extend([_event(2), _event(3)])
    assert len(queue) == 4 and resyncs == []  # the bound itself fits
    queue.extend([_event(4)])
    assert len(queue) == 0 and resyncs == [0] and queue.num_overflows == 1
    queue.extend([_event(i) for i in range(5, 11)])  # one batch past the bound: dropped too
    assert len(queue) == 0 and resyncs == [0, 0] and queue.num_overflows == 2
    queue.extend([_event(11), _event(12)])
    assert queue.take(1) == [_event(11)] and queue.take(10) == [_event(12)]
    assert queue.take(10) == []
    queue.extend([_event(i) for i in range(5)])  # caught up in between: news again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "re-announce" in warnings[0].getMessage()
    assert resyncs == [0, 0, 0]
    with pytest.raises(ValueError, match="max_events"):
        KVEventQueue(lambda: None, max_events=0)


def test_an_overflowing_server_queue_ends_with_the_whole_cache(
    tiny_model_dir, caplog: pytest.LogCaptureFixture,
) -> None:
    """A real core on its thread, a queue bound of 3 and nobody draining it: after the
    overflows, what is left replays to exactly the engine's prefix cache."""
    caplog.set_level(logging.WARNING, _QUEUE_LOGGER)
    config = EngineConfig(model=str(tiny_model_dir("LlamaForCausalLM")), num_blocks=20,
                          max_model_len=128)
    core = EngineThread(config, publish_kv_events=True, max_kv_events=3)

    async def generate(rid: str, prompt: list[int], max_tokens: int) -> None:
        done = asyncio.get_running_loop().create_future()

        def sink(update) -> None:
            if isinstance(update, Exception):
                done.set_exception(update)
            elif update.finished and not done.done():
                done.set_result(None)

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        core.submit(rid, prompt, params, None, sink)
        await asyncio.wait_for(done, 60)

    async def run() -> list[KVEvent]:
        core.start(asyncio.get_running_loop())
        try:
            return await overflow_then_settle()
        finally:
            await asyncio.to_thread(core.stop)  # while the loop still takes its batches

    async def overflow_then_settle() -> list[KVEvent]:
        for _ in range(600):
            if core.is_ready or core.load_error is not None:
                break
            await asyncio.sleep(0.05)
        assert core.is_ready, core.load_error
        prompts = [list(range(10 * i, 10 * i + 40)) for i in range(5)]  # evictions at 20 blocks
        await asyncio.gather(*(generate(f"r{i}", p, 30) for i, p in enumerate(prompts)))
        # Commands are answered in order: once a request submitted after the last resync
        # asked for has finished, that resync's snapshot is queued.
        for i in range(20):
            overflows = core.kv_events.num_overflows
            await generate(f"barrier{i}", [1], 1)
            if core.kv_events.num_overflows == overflows:
                break
        return core.kv_events.take(1000)

    events = asyncio.run(run())
    assert core.kv_events.num_overflows >= 1
    kinds = [e.kind for e in events]
    assert KVEventKind.CLEARED in kinds, kinds
    last_clear = len(kinds) - 1 - kinds[::-1].index(KVEventKind.CLEARED)
    replayed: set[BlockHash] = set()
    for event in events[last_clear + 1:]:
        if event.kind is KVEventKind.REMOVED:
            assert set(event.block_hashes) <= replayed
            replayed -= set(event.block_hashes)
        else:
            replayed |= set(event.block_hashes)
    cache = core.core.engine.block_manager.snapshot_events()  # the core is idle and stopped
    assert replayed == (set(cache[1].block_hashes) if len(cache) > 1 else set())
    assert replayed  # the prompts' blocks are cached
    warnings = [r for r in caplog.records if r.name == _QUEUE_LOGGER]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


async def _generate(core: EngineThread, rid: str, prompt: list[int], max_tokens: int) -> None:
    done = asyncio.get_running_loop().create_future()

    def sink(update) -> None:  # noqa: ANN001
        if isinstance(update, Exception):
            done.set_exception(update)
        elif update.finished and not done.done():
            done.set_result(None)

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    core.submit(rid, prompt, params, None, sink)
    await asyncio.wait_for(done, 60)


def test_events_on_redis_carry_token_ids_only_when_asked(tiny_model_dir) -> None:  # noqa: ANN001
    """Through a real redis-server's channel, read as any subscriber would: by default a
    stored block is its hash and nothing of the prompt; with ``kv_events_token_ids`` the
    tokens come too (vLLM's shape). The routers' index is filled either way."""
    config = EngineConfig(model=str(tiny_model_dir("LlamaForCausalLM")), num_blocks=20,
                          max_model_len=128)
    core = EngineThread(config, publish_kv_events=True)
    prompts = {False: list(range(100, 133)), True: list(range(200, 233))}  # two blocks each

    async def run(server: RedisServer) -> dict[bool, list]:
        core.start(asyncio.get_running_loop())
        try:
            for _ in range(600):
                if core.is_ready or core.load_error is not None:
                    break
                await asyncio.sleep(0.05)
            assert core.is_ready, core.load_error
            return {flag: await publish(server, flag) for flag in (False, True)}
        finally:
            await asyncio.to_thread(core.stop)

    async def publish(server: RedisServer, with_tokens: bool) -> list:
        cfg = ServerConfig(redis_url=server.url, kv_events_token_ids=with_tokens,
                           engine_id=f"e-{with_tokens}")
        publisher = EnginePublisher(cfg, core)
        sub = redis.Redis.from_url(server.url).pubsub()
        sub.subscribe(RedisKeys().kv_events(core.info.model_name))
        try:
            await _generate(core, f"r-{with_tokens}", prompts[with_tokens], 2)
            for _ in range(200):  # the step's events reach the queue on the loop
                if len(core.kv_events):
                    break
                await asyncio.sleep(0.01)
            await publisher.publish_once()
            index = redis.Redis.from_url(server.url)
            blocks = index.zcard(RedisKeys().blocks(core.info.model_name, cfg.engine_id))
            assert blocks >= 2  # the index needs no tokens
            stored = []
            while (msg := sub.get_message(timeout=1.0)) is not None or not stored:
                if msg is None:
                    break
                if msg["type"] == "message":
                    _ts, events, _engine = msgpack.unpackb(msg["data"], raw=False)
                    stored += [e for e in events if e[0] == "BlockStored"]
            return stored
        finally:
            sub.close()
            await publisher.close()

    with RedisServer() as server:
        seen = asyncio.run(run(server))
    assert seen[False] and all(e[3] == [] for e in seen[False])  # no token ids at all
    # Under the flag the new blocks come with their tokens (a re-announcement of the cache,
    # asked by the first heartbeat, names hashes only, with or without it).
    with_tokens = [e for e in seen[True] if e[3]]
    assert [t for e in with_tokens for t in e[3]] == prompts[True][:32]
    assert all(len(e[1]) * e[4] == len(e[3]) for e in with_tokens)
