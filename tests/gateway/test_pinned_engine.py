"""The gateway pinned to one engine (``--engine-url``, an engine pod's OpenAI front): no router,
the engine's ``/health`` says what it serves and whether it is ready, and a failing engine is
the answer (no other engine to retry on). The real processes are in
tests/e2e/test_gateway_api_pool.py; here the engine is tests/gateway/fakes.py's, to make it fail
on cue."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import openai
import pytest
import pytest_asyncio

from services.gateway.config import GatewayConfig, ModelSpec
from services.gateway.server import create_app
from services.text.tokenizer import Tokenizer
from tests.gateway.conftest import MODEL
from tests.gateway.fakes import FakeEngine, serve

pytestmark = pytest.mark.asyncio

KEY = "sk-front"
TEXT = "one two three four"


@pytest_asyncio.fixture
async def pinned(tokenizer: Tokenizer, default_model_path: Path
                 ) -> AsyncIterator[tuple[FakeEngine, str]]:
    async with _pinned(tokenizer, default_model_path, None) as both:
        yield both


@asynccontextmanager
async def _pinned(tokenizer: Tokenizer, default_model_path: Path, adapters: list[dict] | None
                  ) -> AsyncIterator[tuple[FakeEngine, str]]:
    """A fake engine serving ``adapters`` (None: no adapter route), and the front pinned to
    it, started once the engine answers as it will."""
    engine = FakeEngine("the-engine")
    engine.behaviour.script = tokenizer.encode(TEXT, add_special_tokens=False)
    engine.adapters = adapters
    await engine.start()
    config = GatewayConfig(host="127.0.0.1", port=0, engine_url=engine.url, api_keys=(KEY,),
                           models=(ModelSpec(MODEL, str(default_model_path)),))
    runner, url = await serve(create_app(config, tokenizers={MODEL: tokenizer}))
    try:
        yield engine, url
    finally:
        await runner.cleanup()
        await engine.stop()


def client(url: str, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=15)


async def test_serves_the_engines_model_and_enforces_keys(pinned: tuple[FakeEngine, str]
                                                         ) -> None:
    engine, url = pinned
    async with client(url) as c:
        chat = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16)
        assert chat.choices[0].message.content == TEXT
        assert [m.id for m in (await c.models.list()).data] == [MODEL]
    assert len(engine.requests) == 1
    async with client(url, "sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=16)
    assert len(engine.requests) == 1  # refused before the engine


async def test_a_failing_engine_is_a_503_without_retry(pinned: tuple[FakeEngine, str]) -> None:
    engine, url = pinned
    engine.behaviour.mode = "http500"
    async with client(url) as c:
        with pytest.raises(openai.InternalServerError) as exc:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=16)
    assert exc.value.status_code == 503
    assert len(engine.requests) == 1  # nothing else to try


async def test_not_ready_while_the_engine_is_not(pinned: tuple[FakeEngine, str]) -> None:
    engine, url = pinned
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 200
            assert (await resp.json())["live_models"] == [MODEL]
        engine.health_status = 503  # loading, or draining
        async with s.get(f"{url}/ready") as resp:
            assert resp.status == 503
            assert "the engine is unavailable" in (await resp.json())["error"]["message"]
    async with client(url) as c:
        with pytest.raises(openai.InternalServerError) as exc:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=16)
    assert exc.value.status_code == 503 and "no engine available" in str(exc.value)
    assert not engine.requests
    engine.health_status = 200  # back: served again, without waiting for the next poll
    async with client(url) as c:
        out = await c.completions.create(model=MODEL, prompt="x", max_tokens=16)
    assert out.choices[0].text == TEXT


async def test_an_engine_of_another_model_serves_nothing(pinned: tuple[FakeEngine, str]
                                                        ) -> None:
    engine, url = pinned
    engine.model = "other-model"
    async with client(url) as c:
        assert [m.id for m in (await c.models.list()).data] == []
        with pytest.raises(openai.InternalServerError) as exc:
            await c.completions.create(model=MODEL, prompt="x", max_tokens=16)
    assert "serves 'other-model'" in str(exc.value)
    assert not engine.requests


SQL = {"name": "sql", "version": "v1-sql", "residency": 2, "path": "/adapters/sql"}


async def test_the_engines_adapters_are_listed_and_served(tokenizer: Tokenizer,
                                                         default_model_path: Path) -> None:
    """The engine's adapters (its internal list, which its heartbeat reports too) reach the
    front: listed by /v1/models with parent and root, and a request naming one runs on the
    engine under it; a name it does not serve is a 404."""
    async with _pinned(tokenizer, default_model_path, [SQL]) as (engine, url), client(url) as c:
        cards = {m.id: m for m in (await c.models.list()).data}
        assert sorted(cards) == sorted([MODEL, "sql"])
        assert (cards["sql"].parent, cards["sql"].root) == (MODEL, "/adapters/sql")
        out = await c.completions.create(model="sql", prompt="x", max_tokens=16)
        assert out.model == "sql" and out.choices[0].text == TEXT
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="nosql", prompt="x", max_tokens=16)
        assert [r.lora_name for r in engine.requests] == ["sql"]


async def test_an_engine_without_the_adapter_route_serves_no_adapter(
        pinned: tuple[FakeEngine, str]) -> None:
    engine, url = pinned  # an engine older than the route: a 404, no adapters
    async with client(url) as c:
        assert [m.id for m in (await c.models.list()).data] == [MODEL]
        out = await c.completions.create(model=MODEL, prompt="x", max_tokens=16)
        assert out.choices[0].text == TEXT
    assert engine.requests[0].lora_name is None
