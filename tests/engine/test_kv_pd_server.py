"""P/D between two real engine server processes: the prefill leg's finished frame carries the
kv_transfer_params, the decode leg with them answers as one engine would while its prompt was
served from the pull (cached_tokens); with the prefill engine killed, the decode engine
recomputes and still answers; both ends count the transfer on /metrics. Streamed, the params
come in a ``kv_transfer`` frame ahead of any token, and a prefill engine killed while its
blocks stream costs the decode engine a recompute of the rest."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.protocol import engine_api
from services.protocol.sampling_params import SamplingParams
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, internal_headers

BS = 16
ENV = {"OMP_NUM_THREADS": "1"}  # the session's internal token (tests/conftest.py) inherited


def _engine(model: Path, redis: RedisServer, name: str, role: str,
            *extra: str) -> ServiceProcess:
    config = {"kv_connector": "PagodaPDConnector", "kv_role": role,
              "kv_connector_extra_config": {"host": "127.0.0.1"}}
    return ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(model), "--engine-id", name, "--redis-url", redis.url,
         "--num-blocks", "128", "--block-size", str(BS),
         "--kv-transfer-config", json.dumps(config), *extra], env=ENV)


@pytest.fixture(scope="module")
def pair(fast_model_dir: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with RedisServer() as redis:
        prefill = _engine(fast_model_dir, redis, "prefill", "kv_producer").launch()
        decode = _engine(fast_model_dir, redis, "decode", "kv_consumer").launch()
        try:
            prefill.wait_healthy()
            decode.wait_healthy()
            yield prefill, decode
        finally:
            prefill.stop()
            decode.stop()


async def _generate(url: str, rid: str, prompt: list[int], max_tokens: int,
                    kv: dict[str, Any] | None, salt: str | None = None
                    ) -> tuple[list[int], engine_api.FinishedFrame]:
    body = engine_api.GenerateRequest(rid, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=0, ignore_eos=True), cache_salt=salt,
        kv_transfer_params=kv)
    tokens, dec = [], engine_api.FrameDecoder()
    session = aiohttp.ClientSession(headers=internal_headers())
    async with session as s, s.post(url + engine_api.GENERATE_PATH, data=body.to_msgpack()) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            for frame in dec.feed(chunk):
                if isinstance(frame, engine_api.TokensFrame):
                    tokens += frame.token_ids
                else:
                    assert isinstance(frame, engine_api.FinishedFrame), frame
                    return tokens, frame
    raise AssertionError("no finished frame")


async def _metric(url: str, name: str, label: str = "") -> float:
    """The sum of the engine's /metrics samples named ``name`` with ``label`` (0: none)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and label in line)


async def _sent_metric(url: str, name: str, expected: float) -> float:
    """The prefill side's "sent" sample, waited for: its sender thread counts a transfer after
    the last frame is written, which the puller may have read (and answered from) first."""
    deadline = time.monotonic() + 5.0
    while (value := await _metric(url, name, "sent")) != expected and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return value


def test_two_engine_processes_serve_prefill_then_decode(
        pair: tuple[ServiceProcess, ServiceProcess]) -> None:
    prefill, decode = pair

    async def main() -> None:
        prompt = [5 + (i * 17) % 800 for i in range(3 * BS + 7)]
        alone, _ = await _generate(prefill.url, "alone", prompt, 8, None)
        _, first = await _generate(prefill.url, "p1", prompt, 1, {"do_remote_decode": True})
        params = first.kv_transfer_params
        assert params is not None and params["do_remote_prefill"] is True
        tokens, done = await _generate(decode.url, "d1", prompt, 8, params)
        assert tokens == alone and done.cached_tokens == 3 * BS
        assert done.kv_transfer_params is None
        pulled = await _metric(decode.url, "pagoda:kv_transfer_bytes_total", "received")
        assert pulled > 0 and pulled % 3 == 0  # three blocks
        assert await _sent_metric(prefill.url, "pagoda:kv_transfer_bytes_total", pulled) == pulled
        assert await _metric(decode.url, "vllm:nixl_xfer_time_seconds_count") == 1
        assert await _metric(decode.url, "vllm:nixl_bytes_transferred_sum") == pulled
        assert await _sent_metric(prefill.url, "pagoda:kv_transfer_seconds_count", 1) == 1
        # Prefill done, then its engine is gone before the pull: the decode recomputes.
        other = [9 + (i * 7) % 800 for i in range(2 * BS + 3)]
        alone2, _ = await _generate(prefill.url, "alone2", other, 8, None)
        _, first2 = await _generate(prefill.url, "p2", other, 1, {"do_remote_decode": True})
        prefill.stop()
        tokens2, done2 = await _generate(decode.url, "d2", other, 8, first2.kv_transfer_params)
        assert tokens2 == alone2 and done2.cached_tokens == 0
        assert await _metric(decode.url, "pagoda:kv_transfer_failures_total",
                             'reason="connection"') == 1
        assert await _metric(decode.url, "vllm:nixl_num_failed_transfers_total") == 1

    asyncio.run(main())


async def _announced(url: str, rid: str, prompt: list[int]
                     ) -> tuple[aiohttp.ClientSession, aiohttp.ClientResponse, dict[str, Any]]:
    """A streamed prefill leg, open: its session, response, and the params it announced."""
    body = engine_api.GenerateRequest(rid, prompt, SamplingParams(
        max_tokens=1, temperature=0, ignore_eos=True),
        kv_transfer_params={"do_remote_decode": True, "kv_stream": True})
    session = aiohttp.ClientSession(headers=internal_headers())
    resp = await session.post(url + engine_api.GENERATE_PATH, data=body.to_msgpack())
    assert resp.status == 200, await resp.text()
    dec = engine_api.FrameDecoder()
    async for chunk in resp.content.iter_any():
        for frame in dec.feed(chunk):
            assert isinstance(frame, engine_api.KVTransferFrame), frame  # before any token
            return session, resp, frame.kv_transfer_params
    raise AssertionError("no kv_transfer frame")


def test_a_prefill_engine_killed_mid_stream_costs_a_recompute(fast_model_dir: Path) -> None:
    """The prefill engine steps slowly (a prompt of 9 chunks at 0.4 s a step): the decode leg
    starts on its announcement, blocks arrive as chunks complete, then the prefill engine is
    killed; the decode engine keeps what arrived and computes the rest."""
    with RedisServer() as redis:
        prefill = _engine(fast_model_dir, redis, "s-prefill", "kv_producer",
                          "--max-num-batched-tokens", str(BS), "--debug-step-delay-s",
                          "0.4").launch()
        decode = _engine(fast_model_dir, redis, "s-decode", "kv_consumer").launch()
        try:
            prefill.wait_healthy()
            decode.wait_healthy()

            async def main() -> None:
                prompt = [7 + (i * 19) % 800 for i in range(8 * BS + 3)]
                alone, _ = await _generate(decode.url, "s-alone", prompt, 8, None, "ref")
                session, resp, params = await _announced(prefill.url, "s-p", prompt)
                assert params["remote_streaming"] is True and params["remote_num_blocks"] == 8
                pull = asyncio.create_task(_generate(decode.url, "s-d", prompt, 8, params))
                await asyncio.sleep(1.5)  # a few blocks in
                prefill.kill()
                resp.close()
                await session.close()
                tokens, done = await pull
                assert tokens == alone and 0 < done.cached_tokens < 8 * BS
                assert await _metric(decode.url, "pagoda:kv_transfer_failures_total",
                                     'reason="connection"') == 1

            asyncio.run(main())
        finally:
            prefill.stop()
            decode.stop()
