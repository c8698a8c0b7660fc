"""The engine server's registry sync beside Redis (issue 33): the app in this process, a real
redis-server. A sync whose load is held up never holds the heartbeat (it keeps its pace); a
registered adapter the engine refuses is quarantined in the registry with its error (the
router's ``GET /adapters`` shows it), the engine stays up and serves, a later sync (a
restart's) does not read it again, and registering it anew clears it. (The hostile paths
from outside, through the whole stack: tests/e2e/test_lora_stack.py.)
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.lora_registry import AdapterRegistry
from services.common.redis_index import connect
from services.engine.config import EngineConfig
from services.engine.lora.manager import LoRAManager
from services.engine.lora.registry_sync import RegistrySync
from services.engine.serving.server import CORE, ServerConfig, create_app
from services.protocol import engine_api
from services.protocol.messages import EngineHeartbeat
from services.protocol.redis_schema import RedisKeys
from services.protocol.sampling_params import SamplingParams
from services.router import adapters as router_adapters
from tests.support.lora import hostile_root, release_fifo, write_adapter
from tests.support.redis_server import RedisServer
from tests.support.services import internal_headers

MODEL = "tiny-lora"
PROMPT = list(range(3, 19))


@pytest.fixture(scope="module")
def llama(tiny_model_dir) -> Path:
    return tiny_model_dir("LlamaForCausalLM")


@pytest.fixture(scope="module")
def root(llama: Path, tmp_path_factory) -> Iterator[Path]:
    good = write_adapter(llama, tmp_path_factory.mktemp("made") / "good", seed=9)
    root = hostile_root(good, tmp_path_factory.mktemp("hostile"))
    yield root
    release_fifo(root / "fifo" / "adapter_model.safetensors")


def _generate_body(rid: str, max_tokens: int, lora: str | None = None) -> bytes:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine_api.GenerateRequest(rid, PROMPT, params, lora_name=lora).to_msgpack()


async def _stream_tokens(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    dec, tokens = engine_api.FrameDecoder(), 0
    async with session.post(url + engine_api.GENERATE_PATH, data=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            for frame in dec.feed(chunk):
                if isinstance(frame, engine_api.TokensFrame):
                    tokens += len(frame.token_ids)
    return tokens


# --------------------------------------------------------------------------- beside Redis


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_a_slow_sync_load_never_holds_the_heartbeat_and_a_bad_entry_is_quarantined(
        llama: Path, root: Path, redis_server: RedisServer, monkeypatch) -> None:
    reading, release = threading.Event(), threading.Event()
    read_names: list[str] = []
    real_read = LoRAManager.read

    def slow_read(self, name, source):  # the "ok" adapter's disk takes its time
        read_names.append(name)
        if name == "ok":
            reading.set()
            release.wait(60)
        return real_read(self, name, source)

    monkeypatch.setattr(LoRAManager, "read", slow_read)
    try:
        asyncio.run(_slow_sync_and_quarantine(llama, root, redis_server.url, reading, release,
                                              read_names))
    finally:
        release.set()


async def _slow_sync_and_quarantine(llama: Path, root: Path, url: str, reading: threading.Event,
                                    release: threading.Event, read_names: list[str]) -> None:
    redis = connect(url)
    registry, keys = AdapterRegistry(redis), RedisKeys()
    await redis.flushall()
    assert await registry.register(MODEL, "fifo", "fifo")
    assert await registry.register(MODEL, "ok", "ok")
    config = EngineConfig(model=str(llama), served_model_name=MODEL, enable_lora=True,
                          num_blocks=64, block_size=8)
    server = ServerConfig(engine_id="e-lora", engine_core="inline", redis_url=url,
                          lora_roots=(str(root),), heartbeat_interval_s=0.1,
                          heartbeat_ttl_s=1.0)
    app = create_app(config, server)
    async with TestClient(TestServer(app), headers=internal_headers()) as client:
        assert await asyncio.to_thread(reading.wait, 60)

        async def heartbeat() -> EngineHeartbeat | None:
            blob = await redis.get(keys.heartbeat(MODEL, "e-lora"))
            return None if blob is None else EngineHeartbeat.from_msgpack(blob)

        for _ in range(100):  # the first heartbeat waits for the first sync, TTL/2 at most
            if await heartbeat() is not None:
                break
            await asyncio.sleep(0.05)
        seen = set()
        for _ in range(12):  # 1.2 s of a load held up: heartbeats every ~0.1 s all along
            hb = await heartbeat()
            assert hb is not None, "no live heartbeat while the sync load waits"
            seen.add(hb.timestamp)
            await asyncio.sleep(0.1)
        assert len(seen) >= 5, seen
        release.set()
        for _ in range(300):
            hb = await heartbeat()
            bad = await registry.quarantined(MODEL)
            if "fifo" in bad and hb is not None and "ok" in {a.name for a in hb.adapters}:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"no quarantine, or ok not loaded: {bad} {hb}")
        assert (bad["fifo"].path, bad["fifo"].engine) == ("fifo", "e-lora")
        assert "not a regular file" in bad["fifo"].error and "ok" not in bad
        assert (await client.get("/health")).status == 200
        resp = await client.post(engine_api.GENERATE_PATH, data=_generate_body("g", 3, "ok"))
        assert resp.status == 200
        await resp.read()
        # A restart's sync does not try the quarantined adapter again.
        assert read_names.count("fifo") == 1
        await RegistrySync(registry, app[CORE], (str(root),), "e-restart").sync_once()
        assert read_names.count("fifo") == 1
        await _router_shows_the_quarantine(registry)
        # Registering it anew (the files mended) clears the quarantine and moves the counter.
        generation = await registry.generation(MODEL)
        assert await registry.register(MODEL, "fifo", "fifo")
        assert await registry.quarantined(MODEL) == {}
        assert await registry.generation(MODEL) == generation + 1
    await redis.aclose()


async def _router_shows_the_quarantine(registry: AdapterRegistry) -> None:
    app = web.Application()
    app[router_adapters.REGISTRY] = registry
    router_adapters.add_routes(app)
    async with TestClient(TestServer(app)) as client:
        body = await (await client.get("/adapters", params={"model": MODEL})).json()
    listed = {a["lora_name"]: a for a in body["adapters"]}
    assert "not a regular file" in listed["fifo"]["quarantined"]["error"]
    assert "quarantined" not in listed["ok"]
