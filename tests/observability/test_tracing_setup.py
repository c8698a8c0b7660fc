"""``services.common.tracing``: off unless an OTLP endpoint is set (and then nothing of the SDK
is loaded), service names, the two OTLP protocols, W3C propagation, bounded shutdown."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest
from opentelemetry import trace

from services.common import tracing
from tests.observability.conftest import global_tracer_provider
from tests.observability.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver
from tests.support.services import REPO

_OFF_CHECK = """
import os, sys
from aiohttp import web
from opentelemetry import trace
from services.common import tracing
import services.gateway.server, services.router.server

assert not any(k.startswith("OTEL_") for k in os.environ)
for name in (tracing.GATEWAY_SERVICE, tracing.ROUTER_SERVICE, tracing.ENGINE_SERVICE):
    assert tracing.setup_tracing(name) is None
assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
assert not tracing.is_enabled(tracing.get_tracer())
span = tracing.get_tracer().start_span("x")
assert not span.is_recording() and not span.get_span_context().is_valid
headers = tracing.inject_headers({})
assert headers == {}, headers
# (redis-py imports opentelemetry.sdk.metrics on its own when the SDK is installed.)
assert not any(m.startswith("opentelemetry.sdk.trace") for m in sys.modules), "SDK tracing loaded"
print("off-ok")
"""


def test_off_when_no_endpoint_is_set_nothing_of_the_sdk_is_loaded() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", _OFF_CHECK],
        cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "off-ok" in out.stdout


def test_enabled_only_with_an_endpoint_and_not_when_disabled() -> None:
    assert not tracing.tracing_enabled({})
    assert tracing.tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing.tracing_enabled({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/t"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    assert not tracing.tracing_enabled({**on, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.tracing_enabled({**on, "OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.trace_prompts({})
    assert tracing.trace_prompts({"PAGODA_TRACE_PROMPTS": "1"})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, "pagoda-router"),
        ({"OTEL_SERVICE_NAME": "router-eu"}, "router-eu"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=r2,deployment.environment=dev"}, "r2"),
    ],
)
def test_service_name_defaults_per_service_and_env_overrides_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: str
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with global_tracer_provider(None):
        provider = tracing.setup_tracing(tracing.ROUTER_SERVICE)
        try:
            assert provider is not None
            assert provider.resource.attributes["service.name"] == expected
            assert trace.get_tracer_provider() is provider  # installed as the global one
        finally:
            provider.shutdown()


def test_protocol_picks_the_exporter(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")

    def exporter_module() -> str:
        return type(tracing._otlp_exporter(tracing.otlp_protocol())).__module__

    assert ".http." in exporter_module()  # the spec's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert ".grpc." in exporter_module()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # wins
    assert ".http." in exporter_module()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with global_tracer_provider(None), caplog.at_level(logging.ERROR):
        assert tracing.setup_tracing(tracing.GATEWAY_SERVICE) is None  # logged, not fatal
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
    assert "http/json" in caplog.text


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_reach_an_otlp_collector(monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
    receiver = OtlpGrpcReceiver() if protocol == "grpc" else OtlpHttpReceiver()
    with receiver, global_tracer_provider(None):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        provider = tracing.setup_tracing(tracing.ENGINE_SERVICE)
        tracer = tracing.get_tracer(provider)
        with tracer.start_as_current_span("parent"), tracer.start_as_current_span("child"):
            pass
        assert tracing.shutdown_tracing(provider, timeout_s=10)
        spans = receiver.wait_for(lambda s: len(s) == 2, timeout_s=5)
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans} == {"pagoda-engine"}
    assert by_name["child"].parent_span_id == by_name["parent"].span_id
    assert by_name["child"].trace_id == by_name["parent"].trace_id


def test_w3c_context_round_trips_through_headers(memory_spans) -> None:
    tracer = tracing.get_tracer()
    with tracer.start_as_current_span("client") as span:
        headers = tracing.inject_headers({"Content-Type": "x"})
    ctx = span.get_span_context()
    flags = f"{int(ctx.trace_flags):02x}"  # sampled, and the W3C level-2 "random" flag
    assert headers["traceparent"] == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags}"
    remote = trace.get_current_span(tracing.extract_context(headers)).get_span_context()
    assert (remote.trace_id, remote.span_id, remote.is_remote) == (ctx.trace_id, ctx.span_id, True)
    assert tracing.inject_headers({}) == {}  # no current span: nothing to propagate


def test_shutdown_gives_up_after_its_timeout_when_the_collector_hangs() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter

    release = threading.Event()

    class Hanging(SpanExporter):
        def export(self, spans):  # type: ignore[no-untyped-def]
            release.wait(10)

        def shutdown(self) -> None:
            release.wait(10)

    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(Hanging()))
    start = time.monotonic()
    try:
        assert tracing.shutdown_tracing(provider, timeout_s=0.3) is False
        assert time.monotonic() - start < 2
    finally:
        release.set()
