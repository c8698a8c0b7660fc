"""An engine core that dies or stops stepping, through a real engine server: its requests fail
at once (an error frame mid-stream, a 503 before the first token), /health stops answering
200, the heartbeat leaves Redis and the server exits 1 (the pod restarts).

Once, an exception escaping the inline core's loop ended its thread silently (/health stayed
200, requests waited out their timeouts), and nothing noticed a core that stopped stepping.
The faults are the server's own testing knobs: ``--debug-crash-after-steps`` (the loop raises)
and ``--debug-step-delay-s`` past ``--step-timeout-s`` (a step that never ends in time)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
import redis

from services.engine.serving.server_config import configs_from_args
from services.protocol import engine_api
from services.protocol.redis_schema import RedisKeys
from services.protocol.sampling_params import SamplingParams
from tests.faults.helpers import wait_for
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, internal_headers

MODEL = "m"
ENGINE_ID = "e-fail"
CLIENT_TIMEOUT_S = 15  # far below the request timeout they once waited out


def _server(model: Path, core: str, *flags: str) -> ServiceProcess:
    return ServiceProcess("services.engine.serving.server", [
        "--model", str(model), "--served-model-name", MODEL, "--engine-id", ENGINE_ID,
        "--engine-core", core, "--num-blocks", "64", "--max-model-len", "128", *flags])


async def _generate(url: str) -> tuple[int, str, list[engine_api.StreamFrame]]:
    """(status, error body, frames) of one long greedy request."""
    body = engine_api.GenerateRequest("r", [5, 6, 7, 8], SamplingParams(
        max_tokens=100, temperature=0, ignore_eos=True)).to_msgpack()
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(headers=internal_headers(), timeout=timeout) as s, s.post(
            url + engine_api.GENERATE_PATH, data=body) as r:
        if r.status != 200:
            return r.status, await r.text(), []
        return 200, "", engine_api.FrameDecoder().feed(await r.read())


def _health(url: str) -> int | None:
    """/health's status; None once the server has gone."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_a_dead_inline_core_fails_its_requests_and_the_engine_leaves(tiny_model_dir) -> None:
    with RedisServer() as redis_server:
        client = redis.Redis.from_url(redis_server.url)
        heartbeat = RedisKeys().heartbeat(MODEL, ENGINE_ID)
        proc = _server(tiny_model_dir("LlamaForCausalLM"), "inline",
                       "--debug-crash-after-steps", "3", "--step-timeout-s", "2",
                       "--redis-url", redis_server.url, "--heartbeat-interval-s", "0.2").start()
        try:
            wait_for(lambda: client.exists(heartbeat), 10, "the engine's heartbeat")
            time.sleep(2.5)  # idle past --step-timeout-s: an idle core owes no progress
            start = time.monotonic()
            status, _, frames = asyncio.run(_generate(proc.url))
            # Two steps' tokens, then the error: at once, not at a timeout.
            assert time.monotonic() - start < 5
            assert status == 200
            # (a stream that fell behind gets both steps' tokens in one frame)
            *tokens, error = frames
            assert all(isinstance(f, engine_api.TokensFrame) for f in tokens), frames
            assert sum(len(f.token_ids) for f in tokens) == 2, frames
            assert isinstance(error, engine_api.ErrorFrame), frames
            assert "engine core thread died" in frames[-1].message
            assert _health(proc.url) != 200
            wait_for(lambda: not client.exists(heartbeat), 5, "the heartbeat leaving Redis")
            assert proc.proc.wait(15) == 1
            assert "injected fault after 3 steps" in proc.log_text()
            assert "engine core stalled" not in proc.log_text()
        finally:
            proc.kill()
            client.close()


@pytest.mark.parametrize("core", ["inline", "process"])
def test_a_stuck_step_fails_its_requests_and_the_engine_exits(tiny_model_dir, core) -> None:
    proc = _server(tiny_model_dir("LlamaForCausalLM"), core, "--debug-step-delay-s", "600",
                   "--step-timeout-s", "1").start()
    try:
        start = time.monotonic()
        status, body, _ = asyncio.run(_generate(proc.url))
        assert time.monotonic() - start < 5
        # Before the first token: a 503, so a gateway tries another engine.
        assert status == 503 and "engine core stalled" in body, (status, body)
        assert _health(proc.url) != 200
        assert proc.proc.wait(15) == 1
        assert "engine core stalled: no step finished" in proc.log_text()
    finally:
        proc.kill()


@pytest.mark.parametrize("argv", [["--step-timeout-s", "-1"], ["--step-timeout-s", "nan"],
                                  ["--debug-crash-after-steps", "-2"]])
def test_the_watchdog_and_fault_flags_are_checked(argv, capsys) -> None:
    assert configs_from_args([])[1].step_timeout_s == 120  # on by default; 0 turns it off
    with pytest.raises(SystemExit) as exit_info:
        configs_from_args(argv)
    assert exit_info.value.code == 2
    assert f"{argv[0]} must be >= 0" in capsys.readouterr().err


def test_a_hung_tensor_parallel_worker_takes_the_engine_out_of_routing(tiny_model_dir) -> None:
    """A core process's worker rank SIGSTOPped: its silent heartbeat link ends the core within
    seconds (not the step watchdog's --step-timeout-s), so /health stops answering 200, the
    heartbeat leaves Redis within 5 s and the server exits 1."""
    with RedisServer() as redis_server:
        client = redis.Redis.from_url(redis_server.url)
        heartbeat = RedisKeys().heartbeat(MODEL, ENGINE_ID)
        proc = _server(tiny_model_dir("LlamaForCausalLM"), "process",
                       "--tensor-parallel-size", "2", "--redis-url", redis_server.url,
                       "--heartbeat-interval-s", "0.2").start()
        worker = 0
        try:
            wait_for(lambda: client.exists(heartbeat), 60, "the engine's heartbeat")
            found = re.search(r"worker rank=1 pid=(\d+) started", proc.log_text())
            assert found, proc.log_tail()
            worker = int(found.group(1))
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            wait_for(lambda: not client.exists(heartbeat), 5, "the heartbeat leaving Redis")
            print(f"\nthe engine left Redis {time.monotonic() - stopped:.2f}s after SIGSTOP")
            assert _health(proc.url) != 200
            assert proc.proc.wait(15) == 1
            assert "worker rank 1 (pid" in proc.log_text() and "went silent" in proc.log_text()
        finally:
            with contextlib.suppress(ProcessLookupError):
                if worker:
                    os.kill(worker, signal.SIGKILL)
            proc.kill()
            client.close()
