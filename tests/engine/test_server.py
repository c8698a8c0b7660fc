"""The engine server as a real process: streaming msgpack API, abort on disconnect, metrics,
bad input refused without harming the loop, heartbeats and KV events in a real Redis. In
process: only the client's errors are 400s; an engine bug is a 500."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.common.redis_index import KVIndexReader, connect
from services.engine.config import EngineConfig
from services.engine.serving.server import CORE, ServerConfig, create_app
from services.protocol import engine_api
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import BadRequest
from tests.support.redis_server import RedisServer
from tests.support.services import ServiceProcess, internal_headers


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def engine(default_model_path, redis_server):
    proc = ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(default_model_path), "--engine-id", "e-test",
         "--redis-url", redis_server.url, "--heartbeat-interval-s", "0.2",
         "--num-blocks", "256"],
    )
    with proc:
        yield proc


def gen_body(rid: str, prompt: list[int], **params) -> bytes:
    return engine_api.GenerateRequest(rid, prompt, SamplingParams(**params)).to_msgpack()


async def generate(url: str, body: bytes) -> list[engine_api.StreamFrame]:
    frames = []
    dec = engine_api.FrameDecoder()
    async with aiohttp.ClientSession(headers=internal_headers()) as s, s.post(
            url + engine_api.GENERATE_PATH, data=body) as r:
        assert r.status == 200, await r.text()
        async for chunk in r.content.iter_any():
            frames.extend(dec.feed(chunk))
    return frames


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+-]+)$", text, re.MULTILINE)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_stream_tokens_and_usage(engine) -> None:
    prompt = list(range(100, 140))
    frames = asyncio.run(generate(engine.url, gen_body("a", prompt, max_tokens=8,
                                                       temperature=0, ignore_eos=True)))
    tokens = [t for f in frames if isinstance(f, engine_api.TokensFrame) for t in f.token_ids]
    assert len(tokens) == 8
    last = frames[-1]
    assert isinstance(last, engine_api.FinishedFrame) and last.finish_reason == "length"
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (40, 8, 0)
    again = asyncio.run(generate(engine.url, gen_body("b", prompt, max_tokens=8,
                                                      temperature=0, ignore_eos=True)))
    assert again[-1].cached_tokens == 32  # two full blocks of 16 from the cache
    assert [t for f in again if isinstance(f, engine_api.TokensFrame)
            for t in f.token_ids] == tokens


def test_bad_requests_are_400_and_the_engine_keeps_serving(engine) -> None:
    async def post(data: bytes) -> int:
        async with aiohttp.ClientSession(headers=internal_headers()) as s, s.post(
                engine.url + engine_api.GENERATE_PATH, data=data) as r:
            body = await r.json()
            assert "error" in body
            return r.status

    assert asyncio.run(post(b"\xc1garbage")) == 400
    assert asyncio.run(post(msgpack.packb({"request_id": "x"}))) == 400
    assert asyncio.run(post(msgpack.packb({"request_id": "x", "prompt_token_ids": [1],
                                           "params": {"temperature": -1}}))) == 400
    assert asyncio.run(post(gen_body("long", [1] * 9000))) == 400  # over the context
    frames = asyncio.run(generate(engine.url, gen_body("ok", [5, 6, 7], max_tokens=2)))
    assert isinstance(frames[-1], engine_api.FinishedFrame)


def test_disconnect_aborts_and_frees_blocks(engine) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession(headers=internal_headers()) as s:
            body = gen_body("long", list(range(200, 300)), max_tokens=2000, ignore_eos=True)
            async with s.post(engine.url + engine_api.GENERATE_PATH, data=body) as r:
                await r.content.readany()  # first frame arrived: the request is running
            # leaving the block closes the connection mid-stream
        for _ in range(100):
            if await metric(engine.url, "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.1)
        assert await metric(engine.url, "vllm:num_requests_running") == 0
        assert await metric(engine.url, "pagoda:kv_free_blocks") == 256

    asyncio.run(run())


def test_abort_by_the_callers_request_id(engine) -> None:
    """/internal/abort names the request by the id its caller sent; the stream then ends
    with an "abort" finish and the blocks are free."""
    async def run() -> list[engine_api.StreamFrame]:
        frames: list[engine_api.StreamFrame] = []
        dec = engine_api.FrameDecoder()
        async with aiohttp.ClientSession(headers=internal_headers()) as s:
            body = gen_body("to-abort", list(range(300, 340)), max_tokens=2000, ignore_eos=True)
            async with s.post(engine.url + engine_api.GENERATE_PATH, data=body) as r:
                frames.extend(dec.feed(await r.content.readany()))
                async with s.post(engine.url + engine_api.ABORT_PATH,
                                  json={"request_id": "to-abort"}) as a:
                    assert a.status == 200
                async for chunk in r.content.iter_any():
                    frames.extend(dec.feed(chunk))
        return frames

    frames = asyncio.run(run())
    assert isinstance(frames[-1], engine_api.FinishedFrame) and frames[-1].finish_reason == "abort"
    generated = sum(len(f.token_ids) for f in frames if isinstance(f, engine_api.TokensFrame))
    assert generated < 2000


def test_unknown_paths_and_methods_get_json_errors(engine) -> None:
    async def run() -> None:
        async with aiohttp.ClientSession(headers=internal_headers()) as s:
            for method, path, status in (("GET", "/nope", 404),
                                         ("GET", engine_api.GENERATE_PATH, 405)):
                async with s.request(method, engine.url + path) as r:
                    assert r.status == status
                    body = await r.json()
                    assert set(body["error"]) == {"message", "type", "param", "code"}

    asyncio.run(run())


def test_metrics_use_vllm_names(engine) -> None:
    async def run() -> str:
        # One request first: a histogram's samples appear once it has observed something,
        # so the test does not lean on the module's other tests having run before it.
        await generate(engine.url, gen_body("metrics-names", [1, 2, 3], max_tokens=2))
        async with aiohttp.ClientSession() as s, s.get(engine.url + "/metrics") as r:
            return await r.text()

    text = asyncio.run(run())
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert name in text, name


def test_heartbeat_and_kv_events_reach_redis(engine, redis_server) -> None:
    async def run() -> None:
        asyncio.get_running_loop()
        frames = await generate(engine.url, gen_body("kv", list(range(400, 448)), max_tokens=1))
        assert isinstance(frames[-1], engine_api.FinishedFrame)
        reader = KVIndexReader(connect(redis_server.url))
        try:
            from services.protocol.block_hash import BlockHasher

            hashes = BlockHasher("SmolLM2-135M-Instruct", 16).chain(list(range(400, 448)))
            for _ in range(50):
                result = await reader.lookup("SmolLM2-135M-Instruct", hashes)
                matches = {m.heartbeat.engine_id: m for m in result.engines}
                if "e-test" in matches and matches["e-test"].matched_blocks == 3:
                    break
                await asyncio.sleep(0.1)
            assert matches["e-test"].matched_blocks == 3
            assert matches["e-test"].heartbeat.url == engine.url
        finally:
            await reader._redis.aclose()

    asyncio.run(run())


DRAIN_TOKENS = 200


def test_sigterm_leaves_routing_first_then_drains(default_model_path, redis_server) -> None:
    """SIGTERM mid-stream: the heartbeat disappears from Redis at once, the running request
    still finishes completely, and the process exits cleanly."""
    proc = ServiceProcess(
        "services.engine.serving.server",
        ["--model", str(default_model_path), "--engine-id", "e-drain",
         "--redis-url", redis_server.url, "--heartbeat-interval-s", "0.2",
         "--num-blocks", "128", "--shutdown-timeout", "60"],
    ).start()

    async def live_ids(reader: KVIndexReader) -> set[str]:
        result = await reader.lookup("SmolLM2-135M-Instruct", [])
        return {m.heartbeat.engine_id for m in result.engines}

    async def run() -> list[engine_api.StreamFrame]:
        reader = KVIndexReader(connect(redis_server.url))
        try:
            for _ in range(50):
                if "e-drain" in await live_ids(reader):
                    break
                await asyncio.sleep(0.1)
            assert "e-drain" in await live_ids(reader)
            frames: list[engine_api.StreamFrame] = []
            dec = engine_api.FrameDecoder()
            # Long enough that the SIGTERM is handled while it runs, even on a loaded machine.
            body = gen_body("drain", list(range(500, 540)), max_tokens=DRAIN_TOKENS,
                            ignore_eos=True)
            async with aiohttp.ClientSession(headers=internal_headers()) as s, s.post(
                    proc.url + engine_api.GENERATE_PATH, data=body) as r:
                frames.extend(dec.feed(await r.content.readany()))
                proc.proc.send_signal(signal.SIGTERM)
                left = False
                async for chunk in r.content.iter_any():
                    frames.extend(dec.feed(chunk))
                    left = left or "e-drain" not in await live_ids(reader)
            assert left or "e-drain" not in await live_ids(reader)
            return frames
        finally:
            await reader._redis.aclose()

    try:
        frames = asyncio.run(run())
        tokens = [t for f in frames if isinstance(f, engine_api.TokensFrame) for t in f.token_ids]
        assert isinstance(frames[-1], engine_api.FinishedFrame) and len(tokens) == DRAIN_TOKENS
        assert proc.proc.wait(30) == 0
    finally:
        proc.kill()


# -- in process: a 400 is the client's fault, anything else is the engine's -------------------


@contextlib.asynccontextmanager
async def engine_app(model_dir: Path) -> AsyncIterator[TestClient]:
    """The engine app on a tiny random model (vocabulary 256), context 64, loaded and ready."""
    config = EngineConfig(model=str(model_dir), num_blocks=16, max_model_len=64)
    # The core inline (a thread of this process): the tests below patch the engine itself.
    app = create_app(config, ServerConfig(engine_id="e-in-process", engine_core="inline"))
    async with TestClient(TestServer(app), headers=internal_headers()) as client:
        for _ in range(600):
            if (await client.get("/health")).status == 200:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the engine did not load")
        yield client


def small(prompt: list[int], max_tokens: int = 3) -> bytes:
    return gen_body("r", prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True)


async def post_generate(client: TestClient, body: bytes) -> tuple[int, dict[str, Any] | None]:
    """Posts a request; returns (status, error JSON), or (200, None) after reading the stream."""
    resp = await client.post(engine_api.GENERATE_PATH, data=body)
    if resp.status != 200:
        return resp.status, (await resp.json())["error"]
    frames = engine_api.FrameDecoder().feed(await resp.read())
    assert isinstance(frames[-1], engine_api.FinishedFrame), frames
    return 200, None


def raising(exc: Exception) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return fail


def test_client_errors_are_400_naming_the_param(tiny_model_dir) -> None:
    async def run() -> None:
        async with engine_app(tiny_model_dir("LlamaForCausalLM")) as client:
            cases = [
                (small([1, 256]), "prompt_token_ids"),  # past the vocabulary
                (small([5] * 64), "prompt_token_ids"),  # fills the context
                (small([5] * 10, max_tokens=65), "max_tokens"),  # more than the context
                (  # refused by the parser
                    msgpack.packb(
                        {"request_id": "r", "prompt_token_ids": [5], "params": {"top_k": -5}}
                    ),
                    "top_k",
                ),
            ]
            for body, param in cases:
                status, err = await post_generate(client, body)
                assert status == 400, err
                assert (err["param"], err["type"]) == (param, "invalid_request_error"), err
                assert err["message"].startswith(param), err
            assert (await post_generate(client, small([5, 6, 7])))[0] == 200

    asyncio.run(run())


def test_an_engine_failure_is_a_500_never_a_400(tiny_model_dir) -> None:
    """A plain ValueError from inside the engine is a bug, not bad input: 500, naming itself
    an internal engine error; the engine thread survives it. A BadRequest raised on the engine
    thread is still the client's 400."""

    async def run() -> None:
        async with engine_app(tiny_model_dir("LlamaForCausalLM")) as client:
            core = client.server.app[CORE]
            checks, engine = core.checks, core.core.engine  # the handler's; the engine thread's
            for target, method, exc, expected in [
                (checks, "check", ValueError("max_tokens slipped"), 500),
                (checks, "check", RuntimeError("boom"), 500),
                (engine, "add_request", ValueError("prompt broke an invariant"), 500),
                (engine, "add_request", BadRequest("max_tokens: no", "max_tokens"),
                 400),
            ]:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(target, method, raising(exc))
                    status, err = await post_generate(client, small([5, 6, 7]))
                assert status == expected, (method, exc, err)
                if expected == 500:
                    assert err["message"].startswith("internal engine error"), err
                    assert err["type"] != "invalid_request_error" and err["param"] is None, err
                else:
                    assert err["param"] == "max_tokens", err
                # Nothing leaked, nothing died: the next request streams to the end.
                assert (await post_generate(client, small([5, 6, 7])))[0] == 200
            assert client.server.app[CORE].num_in_flight == 0

    asyncio.run(run())


def test_the_server_describes_the_engine_from_its_info(tiny_model_dir) -> None:
    """/health and vllm:cache_config_info come from the ``EngineInfo`` the core sent (the
    process mode's are checked in test_core_process.py); without Redis nothing consumes KV
    events, so the core records none."""

    async def run() -> None:
        async with engine_app(tiny_model_dir("LlamaForCausalLM")) as client:
            assert await (await client.get("/health")).json() == {
                "status": "ok", "model": client.server.app[CORE].info.model_name,
                "block_size": 16, "max_model_len": 64}
            metrics = await (await client.get("/metrics")).text()
            assert cache_config_info(metrics) == {
                "block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
                "num_gpu_blocks": "16", "prefix_caching_hash_algo": "xxh3_128"}
            prompt = list(range(40))
            for _ in range(2):
                assert (await post_generate(client, small(prompt)))[0] == 200
            core = client.server.app[CORE]
            assert not core.publish_kv_events and len(core.kv_events) == 0
            assert not core.core.engine.block_manager.record_events

    asyncio.run(run())


def cache_config_info(metrics_text: str) -> dict[str, str]:
    m = re.search(r"^vllm:cache_config_info\{([^}]*)\} 1\.0$", metrics_text, re.MULTILINE)
    assert m, "vllm:cache_config_info missing"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    return {k: v for k, v in labels.items() if k not in ("model_name", "engine")}


# -- a stream that fell behind catches up in one frame ----------------------------------------


def test_queued_updates_coalesce_into_one_frame_in_order() -> None:
    from services.engine.engine import RequestUpdate
    from services.engine.serving.server import _coalesced

    def update(toks: list[int], finished: bool = False, **kw: Any) -> RequestUpdate:
        return RequestUpdate("r", toks, [None] * len(toks), finished,
                             finish_reason="length" if finished else None, **kw)

    queue: asyncio.Queue = asyncio.Queue()
    for u in (update([2], num_output_tokens=2), update([3, 4], num_output_tokens=4),
              update([5], True, num_output_tokens=5), update([9])):
        queue.put_nowait(u)
    merged, pending = _coalesced(update([1], prompt_logprobs=[None, {}]), queue)
    assert merged.new_token_ids == [1, 2, 3, 4, 5] and len(merged.new_logprobs) == 5
    assert merged.finished and merged.finish_reason == "length"
    assert merged.num_output_tokens == 5 and merged.prompt_logprobs == [None, {}]
    assert pending is None and queue.qsize() == 1  # nothing after the finish is read

    failure = RuntimeError("engine step failed")
    queue = asyncio.Queue()
    for u in (update([2]), failure, update([3])):
        queue.put_nowait(u)
    merged, pending = _coalesced(update([1]), queue)
    assert merged.new_token_ids == [1, 2] and not merged.finished and pending is failure

    # A step's updates may share one list (the engine's logprobs of rows without them, and
    # what unpickling a step's updates makes of it): a merge never changes it in place.
    shared_ids, shared_lps = [7], [None]
    queue = asyncio.Queue()
    queue.put_nowait(RequestUpdate("r", shared_ids, shared_lps, False))
    merged, _ = _coalesced(RequestUpdate("r", shared_ids, shared_lps, False), queue)
    assert merged.new_token_ids == [7, 7] and merged.new_logprobs == [None, None]
    assert shared_ids == [7] and shared_lps == [None]
