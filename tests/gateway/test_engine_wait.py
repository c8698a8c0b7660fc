"""A model with no ready engine (scale from zero): the gateway holds its requests, bounded in
count and in held body bytes per model and per tenant (then 429) and in seconds (then 503), all
with Retry-After and OpenAI's error body, and serves the held ones as soon as an engine is
there."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from services.gateway.admission import RETRY_AFTER_S
from tests.gateway.conftest import MODEL, Stack, StackFactory
from tests.gateway.fakes import EngineEntry, FakeEngine

pytestmark = pytest.mark.asyncio

BODY = {"model": MODEL, "prompt": "hello there", "max_tokens": 4}


async def post(stack: Stack, body: dict = BODY,
               key: str | None = None) -> tuple[int, dict, dict[str, str]]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{stack.url}/v1/completions", json=body, headers=headers) as resp,
    ):
        return resp.status, await resp.json(), dict(resp.headers)


async def add_engine(stack: Stack, engine_id: str) -> None:
    engine = FakeEngine(engine_id)
    stack.engines[engine_id] = engine
    stack.router.engines.append(EngineEntry(engine_id, await engine.start(), MODEL))


async def held(stack: Stack, n: int) -> None:
    state = stack.app_state
    while state.upstreams.engine_wait.held(MODEL) != n:
        await asyncio.sleep(0.01)


async def test_held_requests_are_served_when_an_engine_starts(make_stack: StackFactory) -> None:
    stack = await make_stack(engines=[], engine_wait_timeout=10.0, engine_wait_max_requests=4)
    tasks = [asyncio.create_task(post(stack)) for _ in range(4)]
    await asyncio.wait_for(held(stack, 4), 5)
    async with aiohttp.ClientSession() as s, s.get(f"{stack.url}/metrics") as resp:
        text = await resp.text()
    assert f'pagoda_gateway_requests_waiting_for_engine{{model="{MODEL}"}} 4.0' in text
    # A fifth is past the count bound: 429 at once, with Retry-After and the OpenAI body.
    status, body, headers = await post(stack)
    assert status == 429 and headers["Retry-After"] == str(RETRY_AFTER_S)
    assert body["error"]["type"] == "rate_limit_error"
    assert body["error"]["code"] == "no_engine_available"
    await asyncio.sleep(1.0)  # the held ones keep asking the router meanwhile
    await add_engine(stack, "late")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert [r[0] for r in results] == [200] * 4
    assert all(r[1]["choices"][0]["finish_reason"] for r in results)
    asks = stack.router.requests
    first = [r for r in asks if r.waited_s == 0]
    again = [r for r in asks if r.waited_s > 0]
    assert len(first) == 5  # 4 held + the refused one, each asked once without waiting
    assert len(again) >= 4 and max(r.waited_s for r in again) >= 1.0
    assert stack.app_state.upstreams.engine_wait.held(MODEL) == 0


async def test_a_request_held_too_long_gets_503_with_retry_after(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(engines=[], engine_wait_timeout=0.8)
    started = time.monotonic()
    status, body, headers = await post(stack)
    waited = time.monotonic() - started
    assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S)
    assert body["error"]["code"] == "no_engine_available"
    assert body["error"]["type"] == "server_error"
    assert "0.8 seconds" in body["error"]["message"]
    assert 0.8 <= waited < 3.0


async def test_without_holding_no_engine_is_503_at_once(make_stack: StackFactory) -> None:
    stack = await make_stack(engines=[])  # engine_wait_timeout defaults to 0
    started = time.monotonic()
    status, body, headers = await post(stack)
    assert time.monotonic() - started < 1.0
    assert status == 503 and headers["Retry-After"] == str(RETRY_AFTER_S)
    assert body["error"]["code"] == "no_engine_available"
    assert [r.waited_s for r in stack.router.requests] == [0.0]


async def test_a_client_that_hangs_up_while_held_leaves_the_count(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(engines=[], engine_wait_timeout=10.0)
    task = asyncio.create_task(post(stack))
    await asyncio.wait_for(held(stack, 1), 5)
    task.cancel()
    await asyncio.wait_for(held(stack, 0), 5)


KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"
BIG = {**BODY, "user": "x" * 10_000}  # about 10 KB held while it waits


async def test_held_bytes_are_bounded_per_model_and_per_tenant(make_stack: StackFactory) -> None:
    """A tenant past its bytes gets 429 while another still queues; past the model's bytes,
    every tenant's big request gets 429 while a small one still fits."""
    stack = await make_stack(engines=[], engine_wait_timeout=10.0, api_keys=(KEY_A, KEY_B),
                             engine_wait_max_bytes=35_000, engine_wait_max_tenant_bytes=25_000)
    wait = stack.app_state.upstreams.engine_wait
    tasks = [asyncio.create_task(post(stack, BIG, KEY_A)) for _ in range(2)]
    await asyncio.wait_for(held(stack, 2), 5)
    assert 20_000 < wait.held_bytes(MODEL) < 21_000
    status, body, headers = await post(stack, BIG, KEY_A)  # A's third: past A's 25 KB
    assert status == 429 and headers["Retry-After"] == str(RETRY_AFTER_S)
    assert body["error"]["code"] == "no_engine_available"
    assert "25000 bytes of this API key's requests" in body["error"]["message"]
    assert KEY_A not in body["error"]["message"]
    tasks.append(asyncio.create_task(post(stack, BIG, KEY_B)))  # B still queues
    await asyncio.wait_for(held(stack, 3), 5)
    status, body, _ = await post(stack, BIG, KEY_B)  # B's second: past the model's 35 KB
    assert status == 429 and "35000 bytes of requests" in body["error"]["message"]
    tasks.append(asyncio.create_task(post(stack, BODY, KEY_B)))  # a small one still fits
    await asyncio.wait_for(held(stack, 4), 5)
    await add_engine(stack, "late")
    results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert [r[0] for r in results] == [200] * 4
    assert wait.held(MODEL) == 0 and wait.held_bytes(MODEL) == 0
    assert not wait._tenant_bytes  # nothing stays behind for a tenant seen once
