"""OpenTelemetry tracing shared by the gateway, router and engine: one module, one setup.

A request is one trace, its W3C ``traceparent`` carried gateway -> router -> engine:

    gateway  SERVER "POST /v1/chat/completions"      (model, usage, time to first token, outcome)
               CLIENT "POST /route"  ──▶ router  SERVER "POST /route"
                                                   INTERNAL "router.decision" (policy, candidates,
                                                            matched blocks, chosen engine)
               CLIENT "POST /internal/generate" ──▶ engine SERVER "POST /internal/generate"
                                                   (events: queued, scheduled, first_token,
                                                    preempted, finished; queue and prefill time)

Tracing is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``..._TRACES_ENDPOINT``) is set;
then ``setup_tracing`` installs an SDK provider exporting OTLP over HTTP/protobuf or gRPC, as
``OTEL_EXPORTER_OTLP_PROTOCOL`` says (every other standard ``OTEL_*`` variable works too:
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
``OTEL_EXPORTER_OTLP_HEADERS``, ...). Unset, nothing of the SDK's tracing is even imported:
the services hold the API's ``NoOpTracer`` and skip span and header work altogether
(``is_enabled``), so the hot path pays one ``isinstance`` per request.

Prompt text goes into spans only with ``PAGODA_TRACE_PROMPTS=1``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Collection, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, StatusCode

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

logger = logging.getLogger(__name__)

GATEWAY_SERVICE = "pagoda-gateway"
ROUTER_SERVICE = "pagoda-router"
ENGINE_SERVICE = "pagoda-engine"
INSTRUMENTATION_NAME = "pagoda"
TRACE_PROMPTS_ENV = "PAGODA_TRACE_PROMPTS"
_SHUTDOWN_TIMEOUT_S = 5.0

# app[TRACER]: the tracer of one service's app, set by ``tracing_ctx``.
TRACER = web.AppKey("tracer", trace.Tracer)
_NOOP_TRACER = trace.NoOpTracer()


def tracing_enabled(env: Mapping[str, str] = os.environ) -> bool:
    """True when an OTLP endpoint is configured and neither ``OTEL_SDK_DISABLED=true`` nor
    ``OTEL_TRACES_EXPORTER=none`` turns tracing off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) or bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def trace_prompts(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(TRACE_PROMPTS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def setup_tracing(service_name: str) -> TracerProvider | None:
    """Installs (as the global provider, unless one is already set) and returns an SDK tracer
    provider exporting OTLP, or returns None and installs nothing when tracing is off.

    ``service_name`` is the default ``service.name``; ``OTEL_SERVICE_NAME`` (or
    ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``) overrides it. A bad exporter
    configuration is logged and leaves tracing off: telemetry never stops a service.
    """
    if not tracing_enabled():
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = otlp_protocol()
    try:
        exporter = _otlp_exporter(protocol)
    except (ImportError, ValueError) as exc:
        logger.error("tracing disabled: cannot create the OTLP exporter: %s", exc)
        return None
    resource = Resource.create({SERVICE_NAME: service_name}).merge(OTELResourceDetector().detect())
    # shutdown_on_exit=False: shutdown_tracing flushes, bounded, from the app's cleanup.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    logger.info("tracing on service=%s otlp=%s", resource.attributes.get(SERVICE_NAME), protocol)
    return provider


def otlp_protocol(env: Mapping[str, str] = os.environ) -> str:
    """The traces' OTLP protocol: the spec's default is http/protobuf."""
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )
    return protocol.strip().lower()


def _otlp_exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use http/protobuf or grpc")
    return OTLPSpanExporter()  # endpoint, headers, timeout, TLS: from the OTEL_* variables


def shutdown_tracing(
    provider: TracerProvider | None, timeout_s: float = _SHUTDOWN_TIMEOUT_S
) -> bool:
    """Exports what is buffered and shuts the provider down; returns False if that took longer
    than ``timeout_s`` (an unreachable collector), leaving the rest to a daemon thread."""
    if provider is None:
        return True
    worker = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        logger.warning("tracing: spans not exported within %.1fs of shutdown", timeout_s)
        return False
    return True


def get_tracer(provider: TracerProvider | None = None) -> trace.Tracer:
    """The provider's tracer, else the global provider's; the API's ``NoOpTracer`` when no
    provider is installed (then ``is_enabled`` is False)."""
    if provider is not None:
        return provider.get_tracer(INSTRUMENTATION_NAME)
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return _NOOP_TRACER
    return trace.get_tracer(INSTRUMENTATION_NAME)


def is_enabled(tracer: trace.Tracer) -> bool:
    return not isinstance(tracer, trace.NoOpTracer)


def tracing_ctx(service_name: str) -> Callable[[web.Application], AsyncIterator[None]]:
    """A ``cleanup_ctx`` entry: sets up tracing, puts the tracer in ``app[TRACER]``, and flushes
    and shuts down on cleanup. Append it first, so it is torn down last."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        provider = setup_tracing(service_name)
        app[TRACER] = get_tracer(provider)
        try:
            yield
        finally:
            if provider is not None:
                await asyncio.to_thread(shutdown_tracing, provider)

    return ctx


# -- W3C context propagation -----------------------------------------------------------------


def inject_headers(
    headers: MutableMapping[str, str], context: Context | None = None
) -> MutableMapping[str, str]:
    """Adds ``traceparent`` (and ``tracestate``/``baggage``) for ``context`` (default: the
    current one) to ``headers``; adds nothing when the context holds no valid span."""
    propagate.inject(headers, context=context)
    return headers


def extract_context(headers: Mapping[str, str]) -> Context:
    return propagate.extract(headers)


# -- spans ----------------------------------------------------------------------------------


def server_span_middleware(paths: Collection[str]) -> Any:
    """An aiohttp middleware giving each request to one of ``paths`` a SERVER span (the
    incoming W3C context is its parent), current while the handler runs, so the handler adds
    its own attributes to ``trace.get_current_span()``. Other paths are not traced, nor any
    while tracing is off."""
    traced = frozenset(paths)

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        tracer = request.app.get(TRACER, _NOOP_TRACER)
        if isinstance(tracer, trace.NoOpTracer) or request.path not in traced:
            return await handler(request)
        with tracer.start_as_current_span(
            f"{request.method} {request.path}",
            context=extract_context(request.headers),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": request.method,
                "http.route": request.path,
                "url.path": request.path,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                resp = await handler(request)
            except web.HTTPException as exc:
                set_http_status(span, exc.status)
                raise
            except asyncio.CancelledError:
                span.set_attribute("pagoda.outcome", "cancelled")
                raise
            except Exception as exc:
                span.record_exception(exc)
                set_http_status(span, 500, type(exc).__name__)
                raise
            set_http_status(span, resp.status)
            return resp

    return middleware


def set_http_status(span: trace.Span, status: int, description: str | None = None) -> None:
    """Server-span convention: 5xx is an error, 4xx is the client's."""
    span.set_attribute("http.response.status_code", status)
    if status >= 500:
        span.set_status(StatusCode.ERROR, description or f"HTTP {status}")


def set_error(span: trace.Span, description: str) -> None:
    span.set_status(StatusCode.ERROR, description)
