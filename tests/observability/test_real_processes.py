"""One request through real processes (redis-server, engine, router, gateway), each exporting
OTLP to a receiver in this test: the gateway and router over HTTP/protobuf, the engine over gRPC.
One trace spans the three services with the right parent links, the engine span carries the
request's lifecycle, and no prompt text is in any span. The Grafana dashboard's metric names are
checked against the live ``/metrics`` of the same processes."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.observability.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, Span
from tests.support.redis_server import RedisServer
from tests.support.services import REPO, ServiceProcess, stop_all

MODEL = "SmolLM2-135M-Instruct"
SECRET = "zebra-umbrella-7731 is my secret passphrase"
DASHBOARD = REPO / "charts" / "pagoda" / "dashboards" / "pagoda.json"


@dataclass
class Stack:
    http: OtlpHttpReceiver
    grpc: OtlpGrpcReceiver
    engine: ServiceProcess
    router: ServiceProcess
    gateway: ServiceProcess

    def spans(self) -> list[Span]:
        return self.http.spans + self.grpc.spans


def otel_env(endpoint: str, protocol: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s of a span ending
        "OMP_NUM_THREADS": "1",
    }


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def wait_live(gateway_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, body = get(gateway_url + "/ready")
        if status == 200 and MODEL in json.loads(body).get("live_models", []):
            return
        time.sleep(0.05)
    raise AssertionError("the gateway never saw a live engine")


@pytest.fixture(scope="module")
def stack(default_model_path: Path) -> Iterator[Stack]:
    with (
        OtlpHttpReceiver() as http,
        OtlpGrpcReceiver() as grpc,
        RedisServer() as redis,
        pytest.MonkeyPatch.context() as mp,
    ):
        for name in list(os.environ):  # the children inherit nothing of an outer OTel setup
            if name.startswith(("OTEL_", "PAGODA_TRACE")):
                mp.delenv(name)
        engine = ServiceProcess(
            "services.engine.serving.server",
            ["--model", str(default_model_path), "--num-blocks", "256",
             "--redis-url", redis.url, "--engine-id", "e1", "--heartbeat-interval-s", "0.3"],
            env=otel_env(grpc.endpoint, "grpc"),
        )
        router = ServiceProcess(
            "services.router",
            ["--host", "127.0.0.1", "--redis-url", redis.url, "--engines", engine.url],
            env=otel_env(http.endpoint, "http/protobuf"),
            health_path="/ready",
        )
        gateway = ServiceProcess(
            "services.gateway",
            ["--host", "127.0.0.1", "--router-url", router.url,
             "--model", f"{MODEL}={default_model_path}", "--engines-refresh", "0.3"],
            env=otel_env(http.endpoint, "http/protobuf"),
        )
        procs = (engine, router, gateway)
        try:
            with ThreadPoolExecutor(len(procs)) as pool:  # start together: the waits overlap
                list(pool.map(ServiceProcess.start, procs))
            wait_live(gateway.url)
            yield Stack(http, grpc, engine, router, gateway)
        finally:
            stop_all(reversed(procs))


def test_one_trace_spans_gateway_router_and_engine(stack: Stack) -> None:
    body = post_json(
        stack.gateway.url + "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": SECRET}],
         "max_tokens": 4, "temperature": 0},
    )
    rid = body["id"]

    def complete(spans: list[Span]) -> bool:
        gw = [s for s in spans if s.attributes.get("gen_ai.response.id") == rid]
        if not gw:
            return False
        mine = [s for s in spans if s.trace_id == gw[0].trace_id]
        return len(mine) >= 6

    deadline = time.monotonic() + 20
    while not complete(stack.spans()):
        assert time.monotonic() < deadline, [(s.service, s.name) for s in stack.spans()]
        time.sleep(0.1)
    spans = stack.spans()
    server = next(s for s in spans if s.attributes.get("gen_ai.response.id") == rid)
    trace = [s for s in spans if s.trace_id == server.trace_id]
    by = {(s.service, s.kind, s.name): s for s in trace}
    assert len(by) == len(trace) == 6, sorted(by)

    gw_route = by["pagoda-gateway", "CLIENT", "POST /route"]
    gw_generate = by["pagoda-gateway", "CLIENT", "POST /internal/generate"]
    router = by["pagoda-router", "SERVER", "POST /route"]
    decision = by["pagoda-router", "INTERNAL", "router.decision"]
    engine = by["pagoda-engine", "SERVER", "POST /internal/generate"]
    assert server.service == "pagoda-gateway" and server.kind == "SERVER"
    assert server.name == "POST /v1/chat/completions" and server.parent_span_id == ""
    assert gw_route.parent_span_id == gw_generate.parent_span_id == server.span_id
    assert router.parent_span_id == gw_route.span_id
    assert decision.parent_span_id == router.span_id
    assert engine.parent_span_id == gw_generate.span_id

    usage = body["usage"]
    a = server.attributes
    assert a["http.response.status_code"] == 200
    assert a["gen_ai.request.model"] == MODEL
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["gen_ai.usage.cache_read.input_tokens"] == usage["prompt_tokens_details"][
        "cached_tokens"
    ]
    assert a["gen_ai.latency.time_to_first_token"] > 0
    assert a["pagoda.outcome"] == "ok"

    d = decision.attributes
    assert d["pagoda.router.policy"] == "prefix"
    assert d["pagoda.router.candidates"] == 1
    assert d["pagoda.engine.id"] == "e1"
    assert d["pagoda.router.prompt_blocks"] == usage["prompt_tokens"] // 16
    assert "pagoda.router.matched_blocks" in d and "pagoda.router.reason" in d

    names = [e.name for e in engine.events]
    assert names[:3] == ["queued", "scheduled", "first_token"] and names[-1] == "finished", names
    e = engine.attributes
    assert e["pagoda.engine.id"] == "e1"
    assert e["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert e["gen_ai.latency.time_in_queue"] >= 0
    assert e["gen_ai.latency.time_in_model_prefill"] > 0
    # (The engine span may end a moment after the gateway's: it ends after the last frame.)
    assert server.start_ns <= gw_generate.start_ns <= engine.start_ns <= engine.end_ns

    for s in spans:  # every span we got, not just this trace's
        text = json.dumps([s.attributes, [ev.attributes for ev in s.events]])
        assert "zebra-umbrella" not in text, (s.service, s.name)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b((?:vllm:|pagoda_)[a-zA-Z0-9_:]+)", expr))


def test_dashboard_queries_use_metrics_the_services_export(stack: Stack) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        t["expr"] for p in dashboard["panels"] for t in p.get("targets", []) if "expr" in t
    ]
    used = set().union(*(metric_names(x) for x in exprs))
    assert len(used) >= 15
    exposed = ""
    for proc in (stack.engine, stack.router, stack.gateway):
        status, body = get(proc.url + "/metrics")
        assert status == 200
        exposed += body.decode()
    # `# TYPE name kind` lines name every family, with or without samples yet.
    families = {}
    for m in re.finditer(r"^# TYPE (\S+) (\S+)$", exposed, re.MULTILINE):
        families[m.group(1)] = m.group(2)
    valid = set()
    for name, kind in families.items():
        if kind == "histogram":
            valid |= {name + "_bucket", name + "_count", name + "_sum"}
        else:  # a counter's TYPE line already says name_total
            valid.add(name)
    assert used <= valid, sorted(used - valid)
