"""A tiny OTLP trace receiver for tests: OTLP/HTTP (protobuf) on a free loopback port, run in a
thread, and an OTLP/gRPC one; both decode ``ExportTraceServiceRequest`` into flat ``Span``s.

    with OtlpHttpReceiver() as rx:          # rx.endpoint = "http://127.0.0.1:PORT"
        ...                                 # services export with OTEL_EXPORTER_OTLP_ENDPOINT
        spans = rx.wait_for(lambda spans: len(spans) >= 5, timeout_s=10)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanPb


@dataclass(slots=True)
class Event:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)
class Span:
    service: str
    name: str
    kind: str  # "SERVER" | "CLIENT" | "INTERNAL" | ...
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[Event] = field(default_factory=list)
    status_code: str = "UNSET"


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attrs(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(req: ExportTraceServiceRequest) -> list[Span]:
    out = []
    for rs in req.resource_spans:
        service = str(_attrs(rs.resource.attributes).get("service.name", ""))
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        service=service,
                        name=s.name,
                        kind=SpanPb.SpanKind.Name(s.kind).removeprefix("SPAN_KIND_"),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[
                            Event(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events
                        ],
                        status_code=s.status.StatusCode.Name(s.status.code).removeprefix(
                            "STATUS_CODE_"
                        ),
                    )
                )
    return out


class _Collected:
    def __init__(self) -> None:
        self._spans: list[Span] = []
        self._cond = threading.Condition()
        self.requests = 0

    def add(self, spans: list[Span]) -> None:
        with self._cond:
            self.requests += 1
            self._spans.extend(spans)
            self._cond.notify_all()

    @property
    def spans(self) -> list[Span]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, done: Callable[[list[Span]], bool], timeout_s: float = 15.0) -> list[Span]:
        """The spans received once ``done(spans)`` holds; AssertionError after the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not done(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(s.service, s.name) for s in self._spans]
                    raise AssertionError(f"spans not received in {timeout_s}s; have {names}")
                self._cond.wait(left)
            return list(self._spans)


class OtlpHttpReceiver(_Collected):
    """``POST /v1/traces`` (application/x-protobuf, optionally gzip/deflate)."""

    def __init__(self) -> None:
        super().__init__()
        collected = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                collected.add(decode(req))
                payload = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.shutdown()
        self._server.server_close()


class OtlpGrpcReceiver(_Collected):
    """The OTLP ``TraceService/Export`` gRPC method on a free loopback port (insecure)."""

    def __init__(self) -> None:
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        collected = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                collected.add(decode(request))
                return ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self._port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    def __enter__(self) -> Self:
        self._server.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._server.stop(grace=None)
