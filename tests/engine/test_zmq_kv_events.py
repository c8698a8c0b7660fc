"""vLLM's KV-event publisher (``--kv-events-config``): a subscriber written with plain pyzmq and
msgpack, as llm-d's are, decodes vLLM's frames and ``KVEventBatch`` shape from a Pagoda engine.

vLLM's layout (msgspec, array-like, trailing defaults omitted), frames [topic, seq, payload]:
  batch        [ts, [event, ...], data_parallel_rank]
  BlockStored  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                lora_id, medium, lora_name]
  BlockRemoved ["BlockRemoved", block_hashes, medium]
  AllBlocksCleared ["AllBlocksCleared"]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from aiohttp.test_utils import TestClient, TestServer

from services.engine.config import EngineConfig
from services.engine.serving.server import CORE, ServerConfig, create_app
from services.engine.serving.zmq_kv_events import KVEventsConfig, ZmqKVEventPublisher
from services.protocol.block_hash import BlockHasher
from services.protocol.kv_events import KVEvent, KVEventKind
from tests.engine.test_server import post_generate, small
from tests.support.redis_server import free_port
from tests.support.services import internal_headers

H = [bytes([i]) * 16 for i in range(3)]


@contextlib.contextmanager
def subscriber(endpoint: str, bind: bool) -> Iterator[zmq.Socket]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    (sock.bind if bind else sock.connect)(endpoint)
    try:
        yield sock
    finally:
        sock.close(linger=0)


def decode(frames: list[bytes]) -> tuple[bytes, int, list[Any]]:
    topic, seq, payload = frames
    return topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)


def test_frames_and_batches_in_vllms_shape() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"  # no wildcard: the publisher connects (vLLM)
    config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                            topic="kv@10.0.0.7@m")
    with subscriber(endpoint, bind=True) as sub:
        pub = ZmqKVEventPublisher(config, resync=lambda: None)
        pub.start()
        try:
            stored = KVEvent(KVEventKind.STORED, tuple(H[1:]), 2, H[0], (5, 6, 7, 8))
            removed = KVEvent(KVEventKind.REMOVED, (H[0],), 2)
            # PUB drops what it sends before the subscription reaches it: probe until it has.
            for _ in range(200):
                pub.submit([KVEvent(KVEventKind.CLEARED)])
                if sub.poll(50):
                    break
            first = decode(sub.recv_multipart())
            pub.submit([stored, removed, KVEvent(KVEventKind.CLEARED)])
            topic, seq, batch = decode(sub.recv_multipart())
            while batch[1] == [["AllBlocksCleared"]]:  # probes still in flight
                topic, seq, batch = decode(sub.recv_multipart())
        finally:
            pub.close()
    assert first[0] == b"kv@10.0.0.7@m" and topic == b"kv@10.0.0.7@m"
    assert seq > first[1]  # one sequence number per batch, rising
    ts, events, dp_rank = batch
    assert isinstance(ts, float) and dp_rank == 0
    assert events == [
        ["BlockStored", H[1:], H[0], [5, 6, 7, 8], 2, None, "GPU", None],
        ["BlockRemoved", [H[0]], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_engine_publishes_its_prefix_cache(tiny_model_dir, tmp_path: Path) -> None:
    """A real engine (tiny model, no Redis): the blocks a request fills arrive as BlockStored
    with the chain hashes, parent and tokens that vLLM's consumers rebuild the cache from."""
    endpoint = f"ipc://{tmp_path}/kv.sock"  # bound by the engine (vLLM's rule for ipc://)
    kv = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                     "endpoint": endpoint, "topic": "kv@e@tiny"})
    prompt = list(range(10, 50))  # two full blocks of 16 and a partial one

    async def run() -> list[Any]:
        config = EngineConfig(model=str(tiny_model_dir("LlamaForCausalLM")), num_blocks=16,
                              max_model_len=64)
        app = create_app(config, ServerConfig(engine_id="e", engine_core="inline",
                                              kv_events_config=kv))
        async with TestClient(TestServer(app), headers=internal_headers()) as client:
            core = client.server.app[CORE]
            for _ in range(1200):
                if (await client.get("/health")).status == 200:
                    break
                assert core.load_error is None, core.load_error
                await asyncio.sleep(0.05)
            with subscriber(endpoint, bind=False) as sub:
                await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
                assert (await post_generate(client, small(prompt)))[0] == 200
                frames = await asyncio.to_thread(sub.recv_multipart)
            # Without Redis the Redis publisher's queue is not fed (nobody would drain it).
            assert len(core.kv_events) == 0
            return [core.info.model_name, *decode(frames)]

    model, topic, seq, (_, events, _) = asyncio.run(run())
    assert (topic, seq) == (b"kv@e@tiny", 0)
    hashes = BlockHasher(model, 16).chain(prompt)
    stored = [e for e in events if e[0] == "BlockStored"]
    assert stored[0] == ["BlockStored", hashes[:2], None, prompt[:32], 16, None, "GPU", None]


@pytest.mark.parametrize("text", [
    "not json", "[1]", '{"enable_kv_cache_events": "yes"}', '{"publisher": "kafka"}',
    '{"replay_endpoint": "tcp://*:5558"}', '{"endpoint": "http://x"}', '{"surprise": 1}',
])
def test_bad_configs_are_refused_at_the_flag(text: str) -> None:
    with pytest.raises(ValueError, match="kv_events_config"):
        ServerConfig(kv_events_config=text)
