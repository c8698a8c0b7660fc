"""Fixtures for the tracing tests: a clean OTEL_* environment, and an SDK provider with an
in-memory exporter installed as the global one for one test (then the previous state back)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from opentelemetry import trace
from opentelemetry.util._once import Once

from tests.support.redis_server import RedisServer


@contextmanager
def global_tracer_provider(provider: trace.TracerProvider | None) -> Iterator[None]:
    """Makes ``provider`` the global tracer provider (None: none set), restoring the previous
    one after. The API sets it once per process; OpenTelemetry's own tests reset it the same
    way."""
    saved = trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    if provider is not None:
        trace.set_tracer_provider(provider)
    try:
        yield
    finally:
        trace._TRACER_PROVIDER, trace._TRACER_PROVIDER_SET_ONCE = saved


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTEL_* or PAGODA_TRACE_* variable of the outer environment leaks into a test."""
    for name in list(os.environ):
        if name.startswith(("OTEL_", "PAGODA_TRACE")):
            monkeypatch.delenv(name)


@pytest.fixture
def memory_spans() -> Iterator[object]:
    """An ``InMemorySpanExporter`` behind the global provider (spans exported as they end)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with global_tracer_provider(provider):
        yield exporter
    provider.shutdown()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server
