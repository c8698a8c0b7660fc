"""Engines failing before and after the first token, clients going away, timeouts, shutdown.
Every case ends promptly; none hangs."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from tests.gateway.conftest import MODEL, Stack, StackFactory

pytestmark = pytest.mark.asyncio

TEXT = "one two three four five six seven eight nine ten"


def script(stack: Stack, text: str = TEXT) -> None:
    ids = stack.tokenizer.encode(text, add_special_tokens=False)
    for e in stack.engines.values():
        e.behaviour.script = ids


async def sse_events(stack: Stack, body: dict) -> list[str]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{stack.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200
        raw = (await resp.read()).decode()
    return [e.removeprefix("data: ") for e in raw.split("\n\n") if e]


@pytest.mark.parametrize("mode", ["dead", "http500", "close_before_frame", "error_first"])
async def test_retry_on_engine_failing_before_first_token(
    make_stack: StackFactory, mode: str
) -> None:
    first = "dead1" if mode == "dead" else "bad"
    stack = await make_stack(engines=[first, "good"])
    script(stack)
    if mode != "dead":
        stack.engines["bad"].behaviour.mode = mode
    for stream in (False, True):
        raw = await stack.client().completions.with_raw_response.create(
            model=MODEL, prompt="x", stream=stream
        )
        assert raw.headers["x-pagoda-engine"] == "good"
        out = raw.parse()
        text = (
            out.choices[0].text
            if not stream
            else "".join([c.choices[0].text async for c in out if c.choices])
        )
        assert text == TEXT
    excludes = [r.exclude for r in stack.router.requests]
    assert excludes == [[], [first], [], [first]]


async def test_all_engines_failing_is_503_after_bounded_retries(
    make_stack: StackFactory,
) -> None:
    stack = await make_stack(engines=["dead1", "dead2", "dead3", "dead4"], max_retries=2)
    with pytest.raises(openai.InternalServerError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x", stream=True)
    assert exc.value.status_code == 503
    assert len(stack.router.requests) == 3  # 1 + max_retries
    stack.router.engines = []
    with pytest.raises(openai.InternalServerError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x")
    assert exc.value.status_code == 503 and exc.value.code == "no_engine_available"


async def test_router_down_is_503(stack: Stack) -> None:
    stack.router.down = True
    with pytest.raises(openai.InternalServerError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x")
    assert exc.value.status_code == 503
    with pytest.raises(openai.InternalServerError):
        await stack.client().models.list()


@pytest.mark.parametrize("mode", ["error_mid", "drop_mid"])
async def test_mid_stream_failure_ends_with_error_event(stack: Stack, mode: str) -> None:
    script(stack)
    stack.engines["e1"].behaviour.mode = mode
    events = await sse_events(stack, {"model": MODEL, "prompt": "x", "stream": True})
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["message"]
    assert any(json.loads(e).get("choices") for e in events[:-2])  # tokens came first
    assert len(stack.router.requests) == 1  # no retry after the first token
    # The openai client surfaces it as an APIError after the good chunks.
    stream = await stack.client().completions.create(model=MODEL, prompt="x", stream=True)
    got = []
    with pytest.raises(openai.APIError):
        async for chunk in stream:
            got.append(chunk)
    assert got


async def test_mid_stream_failure_non_streaming_is_502(stack: Stack) -> None:
    script(stack)
    stack.engines["e1"].behaviour.mode = "drop_mid"
    with pytest.raises(openai.APIStatusError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x")
    assert exc.value.status_code == 502


async def test_n2_one_choice_failing_mid_stream_ends_the_stream(make_stack: StackFactory) -> None:
    stack = await make_stack(engines=["e1"])
    script(stack)
    stack.engines["e1"].behaviour.mode = "error_mid"
    events = await sse_events(stack, {"model": MODEL, "prompt": "x", "n": 2, "stream": True})
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_aborts_the_engine_request(stack: Stack, stream: bool) -> None:
    script(stack, "word " * 200)
    engine = stack.engines["e1"]
    engine.behaviour.delay = 0.02
    # max_tokens: completions stop at 16 tokens by default, before the client gives up
    body = {"model": MODEL, "prompt": "x", "stream": stream, "max_tokens": 1000}
    async with aiohttp.ClientSession() as s:
        if stream:
            resp = await s.post(f"{stack.url}/v1/completions", json=body)
            await resp.content.readuntil(b"\n\n")  # the first chunk
            resp.close()
        else:  # nothing is written to the client until the end: give up while waiting
            waiting = asyncio.create_task(s.post(f"{stack.url}/v1/completions", json=body))
            await _until(lambda: engine.requests)
            await asyncio.sleep(0.1)
            waiting.cancel()
    await asyncio.wait_for(engine.abort_seen.wait(), 5)
    assert engine.aborted == [engine.requests[0].request_id] and not engine.finished
    await _until(lambda: not stack.app_state.generations)


async def test_openai_client_closing_a_stream_aborts(stack: Stack) -> None:
    script(stack, "word " * 200)
    engine = stack.engines["e1"]
    engine.behaviour.delay = 0.02
    stream = await stack.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True
    )
    async for _ in stream:
        break
    await stream.close()
    await asyncio.wait_for(engine.abort_seen.wait(), 5)


async def test_request_timeout(make_stack: StackFactory) -> None:
    stack = await make_stack(request_timeout=0.5)
    script(stack, "word " * 200)
    stack.engines["e1"].behaviour.delay = 0.05
    events = await sse_events(
        stack, {"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 1000}
    )
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the request timed out"
    with pytest.raises(openai.APIStatusError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x")
    assert exc.value.status_code == 504
    stack.engines["e1"].behaviour.mode = "hang"  # not even a first token
    with pytest.raises(openai.APIStatusError) as exc:
        await stack.client().completions.create(model=MODEL, prompt="x", stream=True)
    assert exc.value.status_code == 504
    await asyncio.wait_for(stack.engines["e1"].abort_seen.wait(), 5)


async def test_shutdown_drains_then_ends_open_streams(make_stack: StackFactory) -> None:
    stack = await make_stack(shutdown_grace=0.3)
    script(stack, "word " * 500)
    engine = stack.engines["e1"]
    engine.behaviour.delay = 0.02
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "stream": True, "max_tokens": 1000},
        )
        await resp.content.readuntil(b"\n\n")
        stopping = asyncio.create_task(stack.stop_gateway())
        raw = (await asyncio.wait_for(resp.read(), 10)).decode()
        await asyncio.wait_for(stopping, 10)
    events = [e.removeprefix("data: ") for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    await asyncio.wait_for(engine.abort_seen.wait(), 5)


async def _until(cond, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)
