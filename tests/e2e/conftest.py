"""A whole Pagoda stack of real processes: redis-server, two engines, the router, the gateway."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, stop_all

MODEL = "SmolLM2-135M-Instruct"
ENGINE_BLOCKS = 384  # 6,144 tokens of KV per engine: small, so the suite stays light


@dataclass
class Stack:
    redis: RedisServer
    engines: list[ServiceProcess]
    router: ServiceProcess
    gateway: ServiceProcess

    @property
    def base_url(self) -> str:
        return f"{self.gateway.url}/v1"


def start_engine(model_dir: Path, redis_url: str, engine_id: str) -> ServiceProcess:
    return ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(model_dir), "--engine-id", engine_id, "--redis-url", redis_url,
         "--num-blocks", str(ENGINE_BLOCKS), "--heartbeat-interval-s", "0.5",
         # Not 3 s: with both engines, the router, the gateway and ten clients on two cores,
         # an engine's heartbeats once lapsed that long in CI and the model had no live
         # engine (a 503). A killed engine is still avoided at once: the gateway retries.
         "--heartbeat-ttl-s", "10"],
        env={"OMP_NUM_THREADS": "1"},  # two engines share two cores
    ).start()


def start_router(redis_url: str, engines: list[ServiceProcess], policy: str) -> ServiceProcess:
    return ServiceProcess(
        "services.router",
        ["--host", "127.0.0.1", "--redis-url", redis_url, "--policy", policy,
         "--engines", ",".join(e.url for e in engines)],
        health_path="/ready",
    ).start()


@pytest.fixture(scope="package")
def stack(default_model_path: Path) -> Iterator[Stack]:
    with RedisServer() as redis:
        engines = [start_engine(default_model_path, redis.url, f"engine-{i}") for i in range(2)]
        router = start_router(redis.url, engines, "prefix")
        gateway = ServiceProcess(
            "services.gateway",
            ["--host", "127.0.0.1", "--router-url", router.url,
             "--model", f"{MODEL}={default_model_path}", "--engines-refresh", "0.5"],
        ).start()
        s = Stack(redis, engines, router, gateway)
        try:
            yield s
        finally:
            stop_all((gateway, router, *engines))
