"""``python -m services.router`` as a real process on a free port."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from services.common.redis_index import KVIndexPublisher, connect
from services.protocol.messages import RouteRequest, RouteResponse
from tests.router.util import MODEL, chain, heartbeat, stored
from tests.support.redis_server import free_port
from tests.support.services import internal_headers

REPO = Path(__file__).resolve().parents[2]


def test_help_and_bad_flags() -> None:
    cmd = [sys.executable, "-m", "services.router"]
    out = subprocess.run(
        [*cmd, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    for flag in ("--redis-url", "--engines", "--k8s-service", "--policy", "--hot-spot-ratio"):
        assert flag in out.stdout
    bad = subprocess.run(
        [*cmd, "--policy", "random"], cwd=REPO, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "invalid choice" in bad.stderr
    both = subprocess.run(
        [*cmd, "--engines", "http://a:1", "--k8s-service", "svc"], cwd=REPO,
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert both.returncode == 2 and "not both" in both.stderr


@pytest.mark.asyncio
async def test_router_process_routes_and_stops_on_sigterm(redis_url: str) -> None:
    client = connect(redis_url)
    publisher = KVIndexPublisher(client)
    prompt = chain(4)
    await publisher.publish_heartbeat(heartbeat("a"))
    await publisher.publish_heartbeat(heartbeat("b"))
    await publisher.apply_events("b", MODEL, [stored(prompt)])
    await client.aclose()

    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.router", "--host", "127.0.0.1", "--port", str(port),
        "--redis-url", redis_url, "--log-level", "warning",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5),
                                         headers=internal_headers()) as http:
            await _wait_healthy(http, base, proc)
            body = RouteRequest(MODEL, prompt, 65, request_id="r1").to_msgpack()
            async with http.post(f"{base}/route", data=body) as resp:
                assert resp.status == 200
                answer = RouteResponse.from_msgpack(await resp.read())
            assert (answer.engine_id, answer.matched_blocks) == ("b", 4)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _wait_healthy(
    http: aiohttp.ClientSession, base: str, proc: asyncio.subprocess.Process
) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.returncode is not None:
            out = await proc.stdout.read() if proc.stdout else b""
            raise AssertionError(f"router exited early: {out.decode()}")
        try:
            async with http.get(f"{base}/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("router did not become healthy")
