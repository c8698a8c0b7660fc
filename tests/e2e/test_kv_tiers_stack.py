"""KV tiers through the real stack (redis, two engines with host memory, router, gateway): a
prefix evicted from an engine's pool lives on in its host tier; an independent reader of the
index sees which tier holds each block; the router sends the prefix back to that engine,
which serves it from host memory (usage and /metrics say so)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import msgpack
import redis

from services.protocol.block_hash import BlockHasher
from services.protocol.engine_api import GENERATE_PATH, GenerateRequest
from services.protocol.messages import RouteRequest, RouteResponse
from services.protocol.redis_schema import RedisKeys
from services.protocol.sampling_params import SamplingParams
from services.router.server import MSGPACK
from tests.support.services import internal_headers
from tests.support.stack import PagodaStack, StackOptions, scrape

BS = 16


def _complete(stack: PagodaStack, prompt: list[int]) -> tuple[str, dict]:
    body = json.dumps({"model": stack.model, "prompt": prompt, "max_tokens": 4,
                       "temperature": 0}).encode()
    req = urllib.request.Request(stack.base_url + "/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.headers["x-pagoda-engine"], json.loads(resp.read())


def _generate_on(engine_url: str, prompt: list[int]) -> None:
    body = GenerateRequest(f"evict-{prompt[0]}", prompt,
                           SamplingParams(max_tokens=2, temperature=0)).to_msgpack()
    req = urllib.request.Request(engine_url + GENERATE_PATH, data=body,
                                 headers={"Content-Type": MSGPACK, **internal_headers()})
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def _decoded_events(sub) -> list[tuple[str, list]]:  # noqa: ANN001
    """(engine id, event) of every batch received so far, decoded as vLLM's ``KVEventBatch``."""
    out = []
    while (msg := sub.get_message(timeout=0.2)) is not None:
        if msg["type"] != "message":
            continue
        _ts, events, engine_id = msgpack.unpackb(msg["data"], raw=False)
        out += [(engine_id, e) for e in events]
    return out


def _route(stack: PagodaStack, hashes: list, num_tokens: int) -> RouteResponse:
    req = urllib.request.Request(
        stack.routers[0].url + "/route",
        data=RouteRequest(stack.model, hashes, num_tokens).to_msgpack(),
        headers={"Content-Type": MSGPACK, **internal_headers()})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return RouteResponse.from_msgpack(resp.read())


def test_a_prefix_in_host_memory_is_routed_back_and_served_from_there(
        fast_model_dir: Path) -> None:
    options = StackOptions(engines=2, num_blocks=24,
                           engine_args=[["--kv-offloading-size", "0.01"]] * 2)
    with PagodaStack(fast_model_dir, options) as stack:
        # An independent subscriber: plain redis-py and msgpack on the events channel.
        sub = redis.Redis.from_url(stack.redis.url).pubsub()
        sub.subscribe(RedisKeys().kv_events(stack.model))
        a = [1000 + (i * 7) % 900 for i in range(6 * BS + 5)]
        engine, first = _complete(stack, a)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # Other prompts until A's blocks have left that engine's pool.
        hashes = BlockHasher(stack.model, BS).chain(a)
        index = redis.Redis.from_url(stack.redis.url)
        keys = RedisKeys()
        pool, host = (keys.blocks(stack.model, engine), keys.host_blocks(stack.model, engine))
        url = stack.engines[int(engine.rsplit("-", 1)[1])].url
        for k in range(12):  # straight to that engine (the router would spread them)
            _generate_on(url, [3000 + 1000 * k + (i * 11) % 900 for i in range(6 * BS + 9)])
            time.sleep(0.6)  # a heartbeat: the events reach the index
            if index.zmscore(pool, hashes[:6]) == [None] * 6:
                break
        # The index, read as plain Redis: A is in the engine's host tier, not its pool.
        assert index.zmscore(pool, hashes[:6]) == [None] * 6
        assert None not in index.zmscore(host, hashes[:6])
        other = next(e for e in ("engine-0", "engine-1") if e != engine)
        assert index.zmscore(keys.host_blocks(stack.model, other), hashes[:1]) == [None]
        seen = _decoded_events(sub)
        stored = {(m, tuple(e[1]), e[6]) for m, e in seen if e[0] == "BlockStored"}
        removed = {(m, h, e[2]) for m, e in seen if e[0] == "BlockRemoved" for h in e[1]}
        assert any(m == engine and medium == "GPU" and hashes[0] in hs
                   for m, hs, medium in stored)  # computed into the pool
        assert any(m == engine and medium == "CPU" and set(hashes[:6]) <= set(hs)
                   for m, hs, medium in stored)  # written through to host memory
        assert (engine, hashes[0], "GPU") in removed  # then evicted from the pool
        decision = _route(stack, hashes, len(a))
        assert (decision.engine_id, decision.reason) == (engine, "prefix-hit")
        served_by, again = _complete(stack, a)
        assert served_by == engine
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * BS
        metrics = scrape(url)
        assert metrics["vllm:external_prefix_cache_hits_total"] >= 6 * BS
        by_source = f'{{model_name="{stack.model}",source="external_kv_transfer"}}'
        assert metrics["vllm:prompt_tokens_by_source_total" + by_source] >= 6 * BS
