"""The router as an endpoint picker, driven as an Envoy drives it: a real router process's app
(in process, its gRPC server on loopback), a real Redis, engines registered by heartbeat and
KV events (their real protocol), the message sequences of docs/proposals/004-endpoint-picker-
protocol over a real gRPC channel, answers decoded with the same generated protos.

No Envoy runs here (none installs on this machine): what Envoy does with the answers (routing
on the header or metadata, retries down the list) is not exercised."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_index import KVIndexPublisher
from services.gateway.auth import cache_salt_for, tenant_id
from services.protocol.block_hash import AdapterKey, BlockHasher
from services.protocol.lora_api import IN_SLOT, AdapterStatus
from services.router.ext_proc_server import EXT_PROC_PORT_KEY
from services.router.server import ROUTER_KEY
from services.text.tokenizer import Tokenizer
from tests.router import ext_proc_client as ep
from tests.router.util import BLOCK_SIZE, MODEL, heartbeat, router_client, stored
from tests.support.redis_server import free_port

pytestmark = pytest.mark.asyncio

A, B = "127.0.0.1:9101", "127.0.0.1:9102"  # the engines' endpoints, as the protocol names them
TEXT = " ".join(f"word{i} and some more text about item {i}." for i in range(30))
MESSAGES = [{"role": "user", "content": TEXT}]


@asynccontextmanager
async def picker(redis_url: str, model_dir: Path, **overrides: Any) -> AsyncIterator[Any]:
    config = {"redis_url": redis_url, "ext_proc_port": free_port(),
              "tokenizer": (f"{MODEL}={model_dir}",), **overrides}
    async with router_client(**config) as client:
        port = client.server.app[EXT_PROC_PORT_KEY]
        async with ep.ext_proc_stub(port) as stub:
            yield client, stub


async def register(publisher: KVIndexPublisher, **load: Any) -> None:
    for name, endpoint in (("a", A), ("b", B)):
        # A long TTL: loading tokenizers on a busy machine must not expire the engines.
        await publisher.publish_heartbeat(heartbeat(name, url=f"http://{endpoint}", **load),
                                          ttl_s=300)


@functools.cache
def _tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def blocks_for(model_dir: Path, key: str | None) -> list[bytes]:
    """The chain Pagoda's gateway computes for MESSAGES under ``key``'s tenant."""
    ids = _tokenizer(model_dir).encode_chat(MESSAGES)
    salt = cache_salt_for(None if key is None else tenant_id(key), None)
    hashes = BlockHasher(MODEL, BLOCK_SIZE, salt).chain(ids)
    assert len(hashes) >= 8
    return hashes


def endpoint_of(answer: Any, where: str) -> str:
    common = getattr(answer, where).response
    value = ep.header_mutation(common)["x-gateway-destination-endpoint"]
    assert common.clear_route_cache
    # The protocol: the same value in the header and in envoy.lb dynamic metadata.
    assert ep.lb_metadata(answer)["x-gateway-destination-endpoint"].string_value == value
    return value


async def test_full_duplex_defers_headers_and_picks_the_tenants_prefix(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    # Each engine holds the prompt under a different tenant's salt: the key decides.
    await publisher.apply_events("a", MODEL, [stored(blocks_for(default_model_path, "key-1"))])
    await publisher.apply_events("b", MODEL, [stored(blocks_for(default_model_path, "key-2"))])
    data = ep.chat_body(TEXT, MODEL)
    async with picker(redis_url, default_model_path) as (_, stub):
        for key, first in (("key-1", A), ("key-2", B)):
            async with ep.stream(stub) as s:
                await s.send(ep.headers(key=key), *ep.chunks(data, 3))
                answers = await s.read_all(2)
                # Headers answered only after the body, carrying the pick; then the body sent
                # on whole (FULL_DUPLEX_STREAMED: Envoy keeps none of it).
                assert ep.only(answers) == ["request_headers", "request_body"]
                value = endpoint_of(answers[0], "request_headers")
                assert value.split(",") == [first, B if first == A else A]
                streamed = answers[1].request_body.response.body_mutation.streamed_response
                assert (streamed.body, streamed.end_of_stream) == (data, True)


async def test_buffered_mode_answers_headers_at_once_and_picks_on_the_body(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    await publisher.apply_events("b", MODEL, [stored(blocks_for(default_model_path, None))])
    async with picker(redis_url, default_model_path) as (_, stub), ep.stream(stub) as s:
        await s.send(ep.headers(mode=ep.BUFFERED))
        assert ep.only([await s.read()]) == ["request_headers"]  # CONTINUE, no pick yet
        await s.send(ep.body(ep.chat_body(TEXT, MODEL), True))
        answer = await s.read()
        assert endpoint_of(answer, "request_body").split(",")[0] == B


async def test_subset_hint_limits_the_pick(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    await publisher.apply_events("b", MODEL, [stored(blocks_for(default_model_path, None))])
    data = ep.chat_body(TEXT, MODEL)
    async with picker(redis_url, default_model_path) as (_, stub):
        async with ep.stream(stub) as s:  # b holds the prefix, but only a is allowed
            await s.send(ep.headers(subset=[A]), ep.body(data, True))
            assert endpoint_of(await s.read(), "request_headers") == A
        async with ep.stream(stub) as s:  # nothing in the hint is eligible: 503
            await s.send(ep.headers(subset=["10.9.9.9:8000"]), ep.body(data, True))
            assert (await s.read()).immediate_response.status.code == 503


async def test_no_eligible_endpoint_bad_body_and_oversized_body(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    async with picker(redis_url, default_model_path, ext_proc_max_body_bytes=4096) as (_, stub):
        cases = [
            (ep.chat_body("hi", "no-such-model"), 1, 503),  # no engine serves the model
            (b"{not json", 1, 400),
            (b"[" * 1900 + b"]" * 1900, 1, 400),  # nested past Python's recursion limit
            (json.dumps({"model": MODEL}).encode(), 1, 400),  # neither messages nor prompt
            (ep.chat_body("x" * 5000, MODEL), 4, 413),  # over the limit, in chunks
            (ep.chat_body("x" * 5000, MODEL), 1, 413),  # over the limit, one buffered body
        ]
        for data, n, status in cases:
            async with ep.stream(stub) as s:
                await s.send(ep.headers(), *ep.chunks(data, n))
                answer = await s.read()
                assert answer.immediate_response.status.code == status, (data[:40], status)
                error = json.loads(answer.immediate_response.body)["error"]
                assert error["message"]


async def test_sheds_with_429_when_every_engine_is_saturated(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher, waiting=5)
    async with picker(redis_url, default_model_path, ext_proc_shed_waiting=4) as (client, stub):
        async with ep.stream(stub) as s:
            await s.send(ep.headers(), ep.body(ep.chat_body(TEXT, MODEL), True))
            assert (await s.read()).immediate_response.status.code == 429
        # A shed request went nowhere: no engine holds its blocks or counts it pending.
        prompt = blocks_for(default_model_path, None)
        snapshot = await client.server.app[ROUTER_KEY].index.lookup(MODEL, prompt)
        assert [(v.matched_blocks, v.pending) for v in snapshot.engines] == [(0, 0), (0, 0)]


async def test_served_endpoint_is_read_back_and_responses_pass_through(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    async with picker(redis_url, default_model_path) as (client, stub):
        async with ep.stream(stub) as s:
            await s.send(ep.headers(), ep.body(ep.chat_body(TEXT, MODEL), True))
            pick = endpoint_of((await s.read_all(2))[0], "request_headers").split(",")
            await s.send(ep.response_headers(served=pick[1]))  # a fallback served it
            assert ep.only([await s.read()]) == ["response_headers"]
            chunk = ep.pb.ProcessingRequest(response_body=ep.pb.HttpBody(body=b"data: x\n\n"))
            await s.send(chunk)
            out = (await s.read()).response_body.response.body_mutation.streamed_response
            assert out.body == b"data: x\n\n"
        metrics = await (await client.get("/metrics")).text()
        assert 'pagoda_router_ext_proc_served_total{endpoint="fallback"} 1.0' in metrics
        assert 'pagoda_router_ext_proc_answers_total{status="200"} 1.0' in metrics
        # The fallback now holds the prompt's blocks in the index, as the pick does.
        prompt = blocks_for(default_model_path, None)
        snapshot = await client.server.app[ROUTER_KEY].index.lookup(MODEL, prompt)
        matched = {f"127.0.0.1:{v.heartbeat.url.rsplit(':', 1)[1]}": v.matched_blocks
                   for v in snapshot.engines}
        assert matched == {A: len(prompt), B: len(prompt)}


async def test_target_port_answers_each_pods_openai_front(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    """--ext-proc-target-port (the chart's pools target the engine pods' OpenAI front): Envoy
    gets each picked pod's IP with that port, never the engine's internal one, and the subset
    hint and the served read-back are read in it."""
    pods = {"p1": "10.1.0.1", "p2": "10.1.0.2"}
    for name, ip in pods.items():  # engines advertise their internal port, 8200
        await publisher.publish_heartbeat(heartbeat(name, url=f"http://{ip}:8200"), ttl_s=300)
    await publisher.apply_events("p2", MODEL, [stored(blocks_for(default_model_path, None))])
    data = ep.chat_body(TEXT, MODEL)
    front1, front2 = "10.1.0.1:8000", "10.1.0.2:8000"
    async with picker(redis_url, default_model_path, ext_proc_target_port=8000) as (client,
                                                                                     stub):
        async with ep.stream(stub) as s:
            await s.send(ep.headers(), ep.body(data, True))
            answer, _body = await s.read_all(2)  # full duplex: the body follows the pick
            assert endpoint_of(answer, "request_headers") == f"{front2},{front1}"
            await s.send(ep.response_headers(served=front1))  # the fallback served
            assert ep.only([await s.read()]) == ["response_headers"]
        async with ep.stream(stub) as s:  # p2 holds the prefix, but only p1 is allowed
            await s.send(ep.headers(subset=[front1]), ep.body(data, True))
            assert endpoint_of(await s.read(), "request_headers") == front1
        async with ep.stream(stub) as s:  # the internal port is no endpoint of the pool
            await s.send(ep.headers(subset=["10.1.0.1:8200"]), ep.body(data, True))
            assert (await s.read()).immediate_response.status.code == 503
        metrics = await (await client.get("/metrics")).text()
        assert 'pagoda_router_ext_proc_served_total{endpoint="fallback"} 1.0' in metrics


async def test_an_engines_advertised_front_port_comes_first(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    """Engines on one host (``serve --ext-proc-port``) each advertise their own front's port
    (``--openai-port``, in the heartbeat): the picker answers it, ahead of
    --ext-proc-target-port, which still serves an engine that advertises none."""
    fronts = {"e1": 9301, "e2": 9302, "e3": 0}
    for i, (name, front) in enumerate(fronts.items()):
        hb = replace(heartbeat(name, url=f"http://127.0.0.1:{8201 + i}", waiting=i),
                     openai_port=front)
        await publisher.publish_heartbeat(hb, ttl_s=300)
    async with (picker(redis_url, default_model_path, ext_proc_target_port=8000,
                       ext_proc_endpoints=3) as (_, stub),
                ep.stream(stub) as s):
        await s.send(ep.headers(), ep.body(ep.chat_body(TEXT, MODEL), True))
        answer, _body = await s.read_all(2)
        picked = endpoint_of(answer, "request_headers").split(",")
    assert sorted(picked) == ["127.0.0.1:8000", "127.0.0.1:9301", "127.0.0.1:9302"]


async def test_body_timeout_and_stream_limit(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    async with picker(redis_url, default_model_path, ext_proc_body_timeout_s=0.5,
                      ext_proc_max_streams=2) as (_, stub):
        async with ep.stream(stub) as s1, ep.stream(stub) as s2:
            await s1.send(ep.headers())  # and never the body
            await s2.send(ep.headers())
            await asyncio.sleep(0.1)
            async with ep.stream(stub) as s3:  # a third stream is refused by gRPC
                await s3.send(ep.headers())
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await s3.read()
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (await s1.read(timeout=3)).immediate_response.status.code == 408


async def test_health_serves_only_when_synced(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    async with picker(redis_url, default_model_path) as (client, _):
        port = client.server.app[EXT_PROC_PORT_KEY]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                req = health_pb2.HealthCheckRequest(service=service)
                return (await health.Check(req)).status

            serving = health_pb2.HealthCheckResponse.SERVING
            assert await status("liveness") == serving
            assert await status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
            await register(publisher)  # an engine is known now
            for _ in range(50):
                if await status("envoy.service.ext_proc.v3.ExternalProcessor") == serving:
                    break
                await asyncio.sleep(0.1)
            assert await status("readiness") == serving


async def test_streamed_mode_continues_each_chunk_and_picks_on_the_last(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    await publisher.apply_events("a", MODEL, [stored(blocks_for(default_model_path, None))])
    async with picker(redis_url, default_model_path) as (_, stub), ep.stream(stub) as s:
        await s.send(ep.headers(mode=ep.STREAMED))
        assert ep.only([await s.read()]) == ["request_headers"]  # STREAMED waits for it
        parts = ep.chunks(ep.chat_body(TEXT, MODEL), 3)
        for part in parts[:-1]:
            await s.send(part)
            answer = await s.read()
            assert ep.only([answer]) == ["request_body"]
            assert not answer.request_body.response.HasField("header_mutation")
        await s.send(parts[-1])
        assert endpoint_of(await s.read(), "request_body").split(",")[0] == A


async def test_an_adapter_name_picks_the_engine_holding_it(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    """``model`` naming a LoRA adapter: the base model's engines, the one holding it first,
    and the prompt hashed in the adapter's chain (as the gateway hashes it)."""
    sql = AdapterStatus("sql", "v1", IN_SLOT)
    await publisher.publish_heartbeat(
        replace(heartbeat("a", url=f"http://{A}"), adapters=[sql]), ttl_s=300)
    await publisher.publish_heartbeat(heartbeat("b", url=f"http://{B}"), ttl_s=300)
    async with picker(redis_url, default_model_path) as (client, stub):
        async with ep.stream(stub) as s:
            await s.send(ep.headers(), ep.body(ep.chat_body(TEXT, "sql"), True))
            assert endpoint_of(await s.read(), "request_headers").split(",")[0] == A
        ids = _tokenizer(default_model_path).encode_chat(MESSAGES)
        adapter_chain = BlockHasher(MODEL, BLOCK_SIZE, None, adapter=AdapterKey("sql", "v1"))
        snapshot = await client.server.app[ROUTER_KEY].index.lookup(
            MODEL, adapter_chain.chain(ids))
        held = {v.heartbeat.engine_id: v.matched_blocks for v in snapshot.engines}
        assert held["a"] == len(ids) // BLOCK_SIZE  # the pick's write-back, in that chain


async def test_all_streams_together_hold_a_bounded_number_of_body_bytes(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    await register(publisher)
    async with picker(redis_url, default_model_path, ext_proc_max_body_bytes=4096,
                      ext_proc_max_buffered_bytes=6000) as (_, stub):
        async with ep.stream(stub) as s1:
            await s1.send(ep.headers(), ep.body(b" " * 3000, False))  # held, body not ended
            async with ep.stream(stub) as s2:
                await s2.send(ep.headers(), ep.body(b" " * 3500, False))
                assert (await s2.read()).immediate_response.status.code == 503
        # s1 went away mid-body: its bytes are given back, and a body fits again.
        for _ in range(50):
            async with ep.stream(stub) as s3:
                await s3.send(ep.headers(), ep.body(b" " * 3500, False),
                              ep.body(ep.chat_body("hi", MODEL), True))
                answer = await s3.read()
            if not answer.HasField("immediate_response"):
                break
            await asyncio.sleep(0.1)  # the cancelled stream's handler has not ended yet
        assert ep.only([answer]) == ["request_headers"]


async def test_flow_control_queues_sheds_sheddable_with_retry_after_and_releases_the_rest(
    redis_url: str, publisher: KVIndexPublisher, default_model_path: Path
) -> None:
    """Engines whose heartbeats say they are saturated: a sheddable request (priority at or
    past --sheddable-priority) is a 429 with Retry-After within --shed-after-s; a priority-0
    one waits and is picked once a heartbeat shows room."""
    await register(publisher, waiting=3)
    flags = {"flow_control": True, "flow_queue_depth": 2, "sheddable_priority": 1,
             "shed_after_s": 0.5}
    loop = asyncio.get_running_loop()
    async with picker(redis_url, default_model_path, **flags) as (client, stub), \
            ep.stream(stub) as patient, ep.stream(stub) as sheddable:
        await patient.send(ep.headers(key="k1"), ep.body(ep.chat_body(TEXT, MODEL), True))
        # It waits first: arriving after a less urgent waiter, it would pass at once (the
        # most urgent request of this door is not held).
        while "pagoda_router_flow_queued{" not in (text := await (
                await client.get("/metrics")).text()) or 'band="0"' not in text:
            await asyncio.sleep(0.02)
        start = loop.time()
        await sheddable.send(ep.headers(key="k2"),
                             ep.body(ep.chat_body(TEXT, MODEL, priority=5), True))
        shed = (await sheddable.read()).immediate_response
        assert 0.5 <= loop.time() - start < 5.0, shed
        assert shed.status.code == 429
        headers = {h.header.key: h.header.raw_value for h in shed.headers.set_headers}
        assert headers["retry-after"] == b"1"
        first = asyncio.ensure_future(patient.read())
        done, _ = await asyncio.wait({first}, timeout=0.2)
        assert not done, first.result().immediate_response.body  # still held
        await register(publisher, waiting=0)  # the engines report room
        answer = await asyncio.wait_for(first, 10)
        assert endpoint_of(answer, "request_headers") in (f"{A},{B}", f"{B},{A}")
