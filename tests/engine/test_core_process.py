"""The engine core in its own process (``--engine-core process``): the IPC messages survive
their framing, greedy outputs through the server equal the offline engine's, the core's
death ends the server (non-zero, within seconds) and the server's death ends the core."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from services.engine.config import EngineConfig
from services.engine.engine import EngineStats, LLMEngine, RequestUpdate
from services.engine.serving import core_process
from services.engine.serving.core_ipc import LoadFailed, decode, encode
from services.engine.serving.core_loop import (
    BAD_REQUEST,
    Abort,
    Add,
    CoreError,
    CoreOutputs,
    Resync,
    Stop,
)
from services.engine.serving.engine_info import EngineInfo
from services.protocol import engine_api
from services.protocol.engine_api import TokenLogprobs
from services.protocol.kv_events import KVEvent, KVEventKind
from services.protocol.sampling_params import SamplingParams
from services.protocol.structured_outputs import StructuredOutputsParams
from tests.engine.test_server import cache_config_info
from tests.support.services import ServiceProcess, internal_headers

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 40))]


def _outputs(n: int) -> CoreOutputs:
    updates = [
        RequestUpdate(f"r{i}", [i], [None], finished=i % 2 == 0,
                      finish_reason="length" if i % 2 == 0 else None, num_prompt_tokens=60,
                      num_output_tokens=i, arrival_time=1.5, first_token_time=2.5)
        for i in range(n)
    ]
    updates[1].new_logprobs = [TokenLogprobs(1, -0.5, 3, [(1, -0.5), (2, -1.25)])]
    return CoreOutputs(
        updates=updates,
        errors=[CoreError("bad", BAD_REQUEST, "max_tokens: no", "max_tokens")],
        stats=EngineStats(3, 1, 0.25, 10, 40, 100, 50, 2),
        kv_events=[KVEvent(KVEventKind.STORED, (7, 8), 16, None, tuple(range(32))),
                   KVEvent(KVEventKind.CLEARED)],
        step_tokens=n,
        step_ms=1.25,
    )


def test_ipc_messages_round_trip_through_one_frame_each() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=["x"],
                            logit_bias={4: 1.0},
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    messages = [
        Add("r1", [1, 2, 3], params, "salt"), Abort("r1"), Resync(), Stop(),
        _outputs(256), CoreOutputs(), LoadFailed("OSError: no weights"),
        EngineInfo("m", "/m", 2048, 512, 16, 64, (2,), "float32", True, "xxh3_128"),
    ]
    for msg in messages:
        assert decode(encode(msg)) == msg
    # One frame per message over a real pipe, in order, whatever their sizes.
    recv, send = multiprocessing.Pipe(duplex=False)
    for msg in messages:
        send.send_bytes(encode(msg))
    assert [decode(recv.recv_bytes()) for _ in messages] == messages
    # A 256-request step is one message of a few bytes per token, not one per request.
    assert len(encode(_outputs(256))) < 256 * 160
    assert not CoreOutputs() and CoreOutputs(step_tokens=0)


def _core_pid(server_pid: int) -> int:
    """The server's engine-core child (multiprocessing's resource tracker is the other)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    cores = [int(c) for c in children
             if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(cores) == 1, children
    return cores[0]


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            # A zombie (exited, not yet reaped by its parent) counts as gone.
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


async def _greedy(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    async def one(s: aiohttp.ClientSession, i: int, prompt: list[int]) -> list[int]:
        body = engine_api.GenerateRequest(
            f"g{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                            ignore_eos=True)).to_msgpack()
        async with s.post(url + engine_api.GENERATE_PATH, data=body) as r:
            assert r.status == 200, await r.text()
            frames = engine_api.FrameDecoder().feed(await r.read())
        assert isinstance(frames[-1], engine_api.FinishedFrame), frames
        return [t for f in frames if isinstance(f, engine_api.TokensFrame) for t in f.token_ids]

    async with aiohttp.ClientSession(headers=internal_headers()) as s:
        return list(await asyncio.gather(*(one(s, i, p) for i, p in enumerate(prompts))))


async def _described(url: str) -> tuple[dict, dict[str, str]]:
    """/health and vllm:cache_config_info: the server's view of the core's ``EngineInfo``."""
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            health = await r.json()
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    return health, cache_config_info(metrics)


def _offline(model: Path, max_tokens: int) -> list[list[int]]:
    """The same requests stepped by an engine in this process (the tiny model has no
    tokenizer for ``LLM``)."""
    engine = LLMEngine(EngineConfig(model=str(model), num_blocks=64, max_model_len=128))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"g{i}", p, params) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]


def _server(model: Path, env: dict[str, str] | None = None) -> ServiceProcess:
    return ServiceProcess("services.engine.serving.server", [
        "--model", str(model), "--engine-core", "process", "--num-blocks", "64",
        "--max-model-len", "128"], env=env)


def test_the_core_is_forked_only_from_a_single_threaded_server(monkeypatch) -> None:
    monkeypatch.delenv(core_process.START_METHOD_ENV, raising=False)
    monkeypatch.setattr(core_process, "_IMPORT_THREADS", 2)  # OpenBLAS's pool beside main
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    assert core_process.start_method(threads=2) == "fork"
    assert core_process.start_method(threads=3) == "spawn"  # a native thread since
    assert core_process.start_method(threads=2, device="cuda") == "spawn"  # CUDA forbids fork
    monkeypatch.undo()
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)
    extra.start()
    try:  # a Python thread beside this one
        assert core_process.start_method() == "spawn"
    finally:
        stop.set()
        extra.join()
    monkeypatch.setenv(core_process.START_METHOD_ENV, "spawn")
    assert core_process.start_method(threads=1) == "spawn"
    monkeypatch.setenv(core_process.START_METHOD_ENV, "forkserver")
    with pytest.raises(ValueError, match="PAGODA_CORE_START_METHOD must be fork or spawn"):
        core_process.start_method()


def test_greedy_through_the_core_process_then_its_death_ends_the_server(tiny_model_dir) -> None:
    model = tiny_model_dir("LlamaForCausalLM")
    expected = _offline(model, 12)
    proc = _server(model).start()
    try:
        assert "(fork)" in proc.log_text()  # the server had one thread when it started it
        assert asyncio.run(_greedy(proc.url, PROMPTS, 12)) == expected
        assert asyncio.run(_described(proc.url)) == ({
            "status": "ok", "model": model.name, "block_size": 16, "max_model_len": 128}, {
            "block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
            "num_gpu_blocks": "64", "prefix_caching_hash_algo": "xxh3_128"})
        core = _core_pid(proc.proc.pid)
        os.kill(core, signal.SIGKILL)
        start = time.monotonic()
        assert proc.proc.wait(15) == 1  # never a hang, never a clean exit
        assert time.monotonic() - start < 8
        assert "engine core process died" in proc.log_text()
    finally:
        proc.kill()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_core_dies_with_its_server(tiny_model_dir, method: str) -> None:
    proc = _server(tiny_model_dir("LlamaForCausalLM"),
                   {core_process.START_METHOD_ENV: method}).start()
    try:
        assert f"({method})" in proc.log_text()
        core = _core_pid(proc.proc.pid)
        proc.proc.kill()  # SIGKILL: no cleanup code runs in the server
        proc.proc.wait(10)
        assert _gone(core, 10), "the engine core outlived its server"
    finally:
        proc.kill()
