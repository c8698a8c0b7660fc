"""A gateway on a real port in front of fake engines and a fake router (tests/gateway/fakes.py),
with the default model's real tokenizer, talked to with the official ``openai`` client."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from openai import AsyncOpenAI

from services.gateway.config import GatewayConfig, ModelSpec
from services.gateway.server import create_app
from services.gateway.state import STATE, GatewayState
from services.text.tokenizer import Tokenizer
from tests.gateway.fakes import EngineEntry, FakeEngine, FakeRouter, dead_url, serve

MODEL = "smol"


@pytest.fixture(scope="session")
def tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@dataclass
class Stack:
    router: FakeRouter
    engines: dict[str, FakeEngine]
    url: str
    app: web.Application
    tokenizer: Tokenizer
    _runner: web.AppRunner | None = None
    _clients: list[AsyncOpenAI] = field(default_factory=list)

    @property
    def app_state(self) -> GatewayState:
        return self.app[STATE]

    def client(self, api_key: str = "unused") -> AsyncOpenAI:
        c = AsyncOpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=15)
        self._clients.append(c)
        return c

    async def stop_gateway(self) -> None:
        """Graceful shutdown, as on SIGTERM (drain, then cleanup)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def close(self) -> None:
        for c in self._clients:
            await c.close()
        await self.stop_gateway()
        for e in self.engines.values():
            await e.stop()
        await self.router.stop()


StackFactory = Callable[..., Awaitable[Stack]]


@pytest_asyncio.fixture
async def make_stack(tokenizer: Tokenizer, default_model_path: Path) -> AsyncIterator[StackFactory]:
    """``await make_stack(engines=["e1", ("e2", "other-model"), "dead1"], **config)``:
    engines are routed to in list order; ids starting with "dead" refuse connections."""
    stacks: list[Stack] = []

    async def make(
        engines: Sequence[str | tuple[str, str]] = ("e1", "e2"),
        models: Sequence[str] = (MODEL,),
        block_size: int = 16,
        max_model_len: int | None = None,
        hash_algorithm: str = "xxh3_128",
        **config: Any,
    ) -> Stack:
        router = FakeRouter()
        await router.start()
        fakes: dict[str, FakeEngine] = {}
        for spec in engines:
            eid, model = (spec, MODEL) if isinstance(spec, str) else spec
            if eid.startswith("dead"):
                url = dead_url()
            else:
                fakes[eid] = FakeEngine(eid)
                url = await fakes[eid].start()
            router.engines.append(EngineEntry(eid, url, model, block_size, max_model_len,
                                              hash_algorithm))
        cfg = GatewayConfig(
            host="127.0.0.1",
            port=0,
            router_url=router.url,
            models=tuple(ModelSpec(m, str(default_model_path)) for m in models),
            **config,
        )
        app = create_app(cfg, tokenizers={m: tokenizer for m in models})
        runner, url = await serve(app)
        stack = Stack(router, fakes, url, app, tokenizer, runner)
        stacks.append(stack)
        return stack

    yield make
    for s in stacks:
        await s.close()


@pytest_asyncio.fixture
async def stack(make_stack: StackFactory) -> Stack:
    return await make_stack()
