"""Each service's spans, in process, with an in-memory exporter: the gateway in front of fake
upstreams that record the ``traceparent`` they get, the router on a real Redis, the engine on a
tiny random model (with a KV pool small enough to force a preemption)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.common import tracing
from services.common.redis_index import KVIndexPublisher, connect
from services.engine.config import EngineConfig
from services.engine.serving.server import ServerConfig
from services.engine.serving.server import create_app as create_engine_app
from services.gateway.config import GatewayConfig, ModelSpec
from services.gateway.server import create_app as create_gateway_app
from services.protocol import engine_api
from services.protocol.messages import RouteRequest
from services.protocol.sampling_params import SamplingParams
from services.text.tokenizer import Tokenizer
from tests.gateway.fakes import EngineEntry, FakeEngine, FakeRouter, dead_url, serve
from tests.observability.conftest import global_tracer_provider
from tests.router.util import MODEL as ROUTER_MODEL
from tests.router.util import chain, heartbeat, router_client, stored
from tests.support.services import internal_headers

pytestmark = pytest.mark.asyncio

MODEL = "smol"
SECRET = "the quick brown secret fox"


def by_name(spans: Sequence[Any], name: str) -> list[Any]:
    return [s for s in spans if s.name == name]


def one(spans: Sequence[Any], name: str) -> Any:
    found = by_name(spans, name)
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def parent_id(span: Any) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def traceparent_of(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def all_attribute_text(spans: Sequence[Any]) -> str:
    parts = []
    for s in spans:
        parts.append(json.dumps(dict(s.attributes), default=str))
        parts.extend(json.dumps(dict(e.attributes), default=str) for e in s.events)
    return "\n".join(parts)


async def wait_spans(exporter: Any, done: Callable[[Sequence[Any]], bool]) -> Sequence[Any]:
    for _ in range(200):
        spans = exporter.get_finished_spans()
        if done(spans):
            return spans
        await asyncio.sleep(0.02)
    raise AssertionError(f"spans: {[s.name for s in exporter.get_finished_spans()]}")


# -- gateway ----------------------------------------------------------------------------------


class RecordingEngine(FakeEngine):
    def __init__(self, engine_id: str) -> None:
        super().__init__(engine_id)
        self.traceparents: list[str | None] = []

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.traceparents.append(request.headers.get("traceparent"))
        return await super()._generate(request)


class RecordingRouter(FakeRouter):
    traceparents: list[str | None]

    async def _route(self, request: web.Request) -> web.Response:
        self.traceparents.append(request.headers.get("traceparent"))
        return await super()._route(request)


@dataclass
class Gateway:
    url: str
    router: RecordingRouter
    engine: RecordingEngine


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest_asyncio.fixture
async def gateway_factory(
    tokenizer: Tokenizer, default_model_path: Path
) -> AsyncIterator[Callable[..., Any]]:
    """``await gateway_factory(dead_first=False)``: a gateway in front of a recording fake
    router and engine; it traces with the global provider installed when it starts."""
    cleanups: list[Callable[[], Any]] = []

    async def make(dead_first: bool = False) -> Gateway:
        router = RecordingRouter()
        router.traceparents = []
        await router.start()
        cleanups.append(router.stop)
        engine = RecordingEngine("e1")
        engine.behaviour.cached_tokens = 16
        url = await engine.start()
        cleanups.append(engine.stop)
        if dead_first:
            router.engines.append(EngineEntry("dead1", dead_url(), MODEL))
        router.engines.append(EngineEntry("e1", url, MODEL))
        cfg = GatewayConfig(
            host="127.0.0.1",
            port=0,
            router_url=router.url,
            models=(ModelSpec(MODEL, str(default_model_path)),),
        )
        runner, gw_url = await serve(create_gateway_app(cfg, tokenizers={MODEL: tokenizer}))
        cleanups.insert(0, runner.cleanup)
        return Gateway(gw_url, router, engine)

    yield make
    for c in cleanups:
        await c()


@pytest.fixture
def gateway(memory_spans: Any, gateway_factory: Callable[..., Any]) -> Callable[..., Any]:
    """``gateway_factory``, tracing into ``memory_spans``."""
    return gateway_factory


async def chat(url: str, headers: dict[str, str] | None = None, **body: Any) -> dict[str, Any]:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": SECRET}],
        "max_tokens": 3,
        **body,
    }
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=payload, headers=headers or {}) as r,
    ):
        assert r.status == 200, await r.text()
        if body.get("stream"):
            return {"sse": await r.text()}
        return await r.json()


async def test_gateway_spans_link_to_the_router_and_engine_calls(
    gateway: Callable[..., Any], memory_spans: Any
) -> None:
    gw = await gateway()
    client_tracer = tracing.get_tracer()
    with client_tracer.start_as_current_span("client") as client_span:
        headers = tracing.inject_headers({})
    body = await chat(gw.url, headers)
    spans = await wait_spans(memory_spans, lambda s: bool(by_name(s, "POST /v1/chat/completions")))

    server = one(spans, "POST /v1/chat/completions")
    route = one(spans, "POST /route")
    generate = one(spans, "POST /internal/generate")
    assert server.kind == SpanKind.SERVER and route.kind == generate.kind == SpanKind.CLIENT
    # The client's traceparent is the gateway span's parent; one trace throughout.
    assert parent_id(server) == client_span.get_span_context().span_id
    assert {s.context.trace_id for s in (server, route, generate)} == {
        client_span.get_span_context().trace_id
    }
    assert parent_id(route) == parent_id(generate) == server.context.span_id
    # What went out on the wire is the client spans' context.
    assert gw.router.traceparents == [traceparent_of(route)]
    assert gw.engine.traceparents == [traceparent_of(generate)]

    a = server.attributes
    usage = body["usage"]
    assert a["http.response.status_code"] == 200
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
    assert a["gen_ai.usage.cache_read.input_tokens"] == 16
    assert a["gen_ai.latency.time_to_first_token"] > 0
    assert a["pagoda.outcome"] == "ok"
    assert tuple(a["pagoda.engine.ids"]) == ("e1",)
    assert route.attributes["pagoda.engine.id"] == "e1"
    assert generate.attributes["pagoda.outcome"] == "finished"
    assert generate.attributes["gen_ai.usage.output_tokens"] == 3
    assert SECRET not in all_attribute_text(spans)


async def test_streaming_request_records_ttft_and_outcome(
    gateway: Callable[..., Any], memory_spans: Any
) -> None:
    gw = await gateway()
    await chat(gw.url, stream=True, stream_options={"include_usage": True})
    spans = await wait_spans(memory_spans, lambda s: bool(by_name(s, "POST /v1/chat/completions")))
    server = one(spans, "POST /v1/chat/completions")
    assert server.attributes["pagoda.stream"] is True
    assert server.attributes["pagoda.outcome"] == "ok"
    assert server.attributes["gen_ai.latency.time_to_first_token"] > 0
    assert server.attributes["gen_ai.usage.output_tokens"] == 3


async def test_engine_failure_before_first_token_shows_as_a_failed_client_span(
    gateway: Callable[..., Any], memory_spans: Any
) -> None:
    gw = await gateway(dead_first=True)
    await chat(gw.url)
    spans = await wait_spans(memory_spans, lambda s: bool(by_name(s, "POST /v1/chat/completions")))
    routes = by_name(spans, "POST /route")
    generates = sorted(by_name(spans, "POST /internal/generate"), key=lambda s: s.start_time)
    assert len(routes) == 2 and len(generates) == 2
    assert [g.attributes["pagoda.engine.id"] for g in generates] == ["dead1", "e1"]
    assert generates[0].status.status_code == StatusCode.ERROR
    assert generates[1].status.status_code == StatusCode.UNSET
    assert one(spans, "POST /v1/chat/completions").status.status_code == StatusCode.UNSET


async def test_prompt_text_only_when_enabled(
    gateway: Callable[..., Any], memory_spans: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(tracing.TRACE_PROMPTS_ENV, "1")
    gw = await gateway()
    await chat(gw.url)
    spans = await wait_spans(memory_spans, lambda s: bool(by_name(s, "POST /v1/chat/completions")))
    (text,) = one(spans, "POST /v1/chat/completions").attributes["pagoda.prompt.text"]
    assert SECRET in text  # the rendered chat template


async def test_untraced_paths_make_no_spans(gateway: Callable[..., Any], memory_spans: Any) -> None:
    gw = await gateway()
    async with aiohttp.ClientSession() as s:
        for path in ("/health", "/metrics", "/v1/models"):
            async with s.get(gw.url + path) as r:
                assert r.status == 200
    assert memory_spans.get_finished_spans() == ()


async def test_tracing_off_no_spans_and_no_traceparent(gateway_factory: Callable[..., Any]) -> None:
    incoming = {"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"}
    with global_tracer_provider(None):
        gw = await gateway_factory()
        await chat(gw.url, incoming)
    assert gw.router.traceparents == [None]
    assert gw.engine.traceparents == [None]


# -- router -----------------------------------------------------------------------------------


async def test_router_decision_span_is_a_child_of_the_incoming_context(
    memory_spans: Any, redis_server: Any
) -> None:
    aredis = connect(redis_server.url, timeout_s=5.0)
    await aredis.flushall()
    publisher = KVIndexPublisher(aredis)
    prompt = chain(8)
    for engine_id in ("a", "b"):
        await publisher.publish_heartbeat(heartbeat(engine_id))
    await publisher.apply_events("b", ROUTER_MODEL, [stored(prompt[:6])])
    try:
        async with router_client(redis_url=redis_server.url) as client:
            with tracing.get_tracer().start_as_current_span("gateway-client") as parent:
                headers = tracing.inject_headers({"Content-Type": "application/msgpack"})
            req = RouteRequest(ROUTER_MODEL, prompt, 8 * 16 + 1, [], "req-1")
            resp = await client.post("/route", data=req.to_msgpack(), headers=headers)
            assert resp.status == 200
            missing = RouteRequest("no-such-model", prompt, 8 * 16 + 1, [])
            resp = await client.post("/route", data=missing.to_msgpack(), headers=headers)
            assert resp.status == 503
    finally:
        await aredis.aclose()
    spans = memory_spans.get_finished_spans()
    servers = by_name(spans, "POST /route")
    decisions = by_name(spans, "router.decision")
    assert len(servers) == len(decisions) == 2
    ok_server, failed_server = servers
    ok, failed = decisions
    assert ok_server.kind == SpanKind.SERVER and ok.kind == SpanKind.INTERNAL
    assert parent_id(ok_server) == parent.get_span_context().span_id
    assert ok_server.context.trace_id == parent.get_span_context().trace_id
    assert parent_id(ok) == ok_server.context.span_id
    a = ok.attributes
    assert a["pagoda.router.policy"] == "prefix"
    assert a["pagoda.router.reason"] == "prefix-hit"
    assert a["pagoda.router.candidates"] == 2
    assert sorted(a["pagoda.router.candidate_ids"]) == ["a", "b"]
    assert a["pagoda.router.matched_blocks"] == 6
    assert a["pagoda.router.matched_block_ratio"] == 6 / 8
    assert a["pagoda.router.prompt_blocks"] == 8
    assert a["pagoda.engine.id"] == "b"
    assert a["pagoda.request_id"] == "req-1"
    assert a["pagoda.router.lookup_time_s"] >= 0
    assert ok_server.attributes["http.response.status_code"] == 200
    assert failed.status.status_code == StatusCode.ERROR
    assert failed_server.attributes["http.response.status_code"] == 503
    assert failed_server.status.status_code == StatusCode.ERROR


# -- engine -----------------------------------------------------------------------------------


@pytest_asyncio.fixture
async def tiny_engine(memory_spans: Any, tiny_model_dir: Any) -> AsyncIterator[TestClient]:
    """An engine app on a tiny random model with 8 KV blocks of 4 tokens: two requests of
    28 tokens each cannot both fit, so one is preempted."""
    model = tiny_model_dir("LlamaForCausalLM")
    config = EngineConfig(model=str(model), served_model_name="tiny", block_size=4, num_blocks=8)
    app = create_engine_app(config, ServerConfig(engine_id="e-tiny"))
    async with TestClient(TestServer(app), headers=internal_headers()) as client:
        for _ in range(600):
            r = await client.get("/health")
            if r.status == 200:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("tiny engine did not load")
        yield client


async def generate(client: TestClient, rid: str, prompt: list[int], headers: dict) -> list[dict]:
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    body = engine_api.GenerateRequest(rid, prompt, params).to_msgpack()
    resp = await client.post(engine_api.GENERATE_PATH, data=body, headers=headers)
    assert resp.status == 200, await resp.text()
    decoder = engine_api.FrameDecoder()
    frames = []
    async for chunk in resp.content.iter_any():
        frames.extend(decoder.feed(chunk))
    return frames


async def test_engine_span_has_the_request_lifecycle_as_events(
    tiny_engine: TestClient, memory_spans: Any
) -> None:
    tracer = tracing.get_tracer()
    parents, headers = [], []
    for name in ("a", "b"):
        with tracer.start_as_current_span(f"gateway-{name}") as span:
            parents.append(span)
            headers.append(tracing.inject_headers({}))
    results = await asyncio.gather(
        generate(tiny_engine, "a", list(range(1, 9)), headers[0]),
        generate(tiny_engine, "b", list(range(100, 108)), headers[1]),
    )
    assert all(isinstance(frames[-1], engine_api.FinishedFrame) for frames in results)
    spans = await wait_spans(
        memory_spans, lambda s: len(by_name(s, "POST /internal/generate")) == 2
    )
    engine_spans = {parent_id(s): s for s in by_name(spans, "POST /internal/generate")}
    preempted_total = 0
    for parent in parents:
        span = engine_spans[parent.get_span_context().span_id]
        assert span.kind == SpanKind.SERVER
        assert span.context.trace_id == parent.get_span_context().trace_id
        names = [e.name for e in span.events]
        assert names[:3] == ["queued", "scheduled", "first_token"], names
        assert names[-1] == "finished"
        stamps = [e.timestamp for e in span.events if e.name != "preempted"]
        assert stamps == sorted(stamps)
        assert span.start_time <= span.events[0].timestamp <= span.end_time
        a = span.attributes
        assert a["pagoda.engine.id"] == "e-tiny"
        assert a["gen_ai.request.model"] == "tiny"
        assert a["gen_ai.usage.input_tokens"] == 8
        assert a["gen_ai.usage.output_tokens"] == 20
        assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
        assert a["gen_ai.latency.time_in_queue"] >= 0
        assert a["gen_ai.latency.time_in_model_prefill"] > 0
        assert a["gen_ai.latency.time_to_first_token"] >= a["gen_ai.latency.time_in_model_prefill"]
        assert a["http.response.status_code"] == 200
        preempted = [e for e in span.events if e.name == "preempted"]
        assert len(preempted) <= a["pagoda.engine.num_preemptions"]
        assert bool(preempted) == (a["pagoda.engine.num_preemptions"] > 0)
        preempted_total += a["pagoda.engine.num_preemptions"]
    assert preempted_total > 0, "the 8-block pool should have forced a preemption"


async def test_engine_refusal_is_a_4xx_span_not_an_error(
    tiny_engine: TestClient, memory_spans: Any
) -> None:
    body = engine_api.GenerateRequest("x", [1, 2], SamplingParams(max_tokens=1000)).to_msgpack()
    resp = await tiny_engine.post(engine_api.GENERATE_PATH, data=body)
    assert resp.status == 400
    span = one(memory_spans.get_finished_spans(), "POST /internal/generate")
    assert span.attributes["http.response.status_code"] == 400
    assert span.status.status_code == StatusCode.UNSET
    assert trace.get_current_span() is trace.INVALID_SPAN
