"""The Envoy ext_proc messages of the endpoint-picker protocol (gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol), built and read with the generated protos of
``xds-protos``; nothing here decides anything.

- Envoy -> picker: the subset hint, ``filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`` (a list of ``ip:port``, or one comma-separated
  string); the endpoint that served, ``filter_metadata["envoy.lb"]
  ["x-gateway-destination-endpoint-served"]``.
- picker -> Envoy: the header ``x-gateway-destination-endpoint`` and the same value in
  ``dynamic_metadata["envoy.lb"]``: ``ip:port[,ip:port...]``, the pick first; or an immediate
  response (503 none eligible, 429 shed, 4xx the client's request).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from urllib.parse import urlsplit

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
DESTINATION_KEY = "x-gateway-destination-endpoint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
MAX_SUBSET = 4096  # endpoints read from one hint; a pool is far smaller
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def endpoint_of(url: str, port: int = 0) -> str:
    """An engine URL as the protocol names endpoints: ``ip:port`` (``[v6]:port``); ``port``
    (when not 0) in place of the URL's: where the pod serves the data path."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = port or parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def header_values(headers: base_pb2.HeaderMap, wanted: frozenset[str]) -> dict[str, str]:
    """The first value of each wanted header (names lower case, as Envoy sends them)."""
    out: dict[str, str] = {}
    for h in headers.headers:
        key = h.key.lower()
        if key in wanted and key not in out:
            out[key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def subset_hint(msg: pb.ProcessingRequest) -> frozenset[str] | None:
    """The endpoints the data plane allows; None when it sent no hint (the whole pool)."""
    ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    items: list[str] = []
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values[:MAX_SUBSET]
                 if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = [value.string_value]
    found: set[str] = set()
    for item in items:  # at most MAX_SUBSET in all, however the hint is split
        for e in item.split(",", MAX_SUBSET)[:MAX_SUBSET]:
            if e.strip():
                found.add(e.strip())
            if len(found) >= MAX_SUBSET:
                return frozenset(found)
    return frozenset(found)


def served_endpoint(msg: pb.ProcessingRequest) -> str | None:
    ns = msg.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is None or SERVED_KEY not in ns.fields:
        return None
    value = ns.fields[SERVED_KEY]
    return value.string_value if value.WhichOneof("kind") == "string_value" else None


def destination(endpoints: Sequence[str]) -> tuple[pb.CommonResponse, struct_pb2.Struct]:
    """The header mutation and the dynamic metadata that carry one pick (the same value)."""
    assert endpoints, "a destination names at least one endpoint"
    value = ",".join(endpoints)
    header = base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION_KEY, raw_value=value.encode()),
        append_action=_OVERWRITE,
    )
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[header]), clear_route_cache=True
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_KEY: value}})
    return common, metadata


def request_headers_answer(common: pb.CommonResponse | None = None,
                           metadata: struct_pb2.Struct | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(response=common or pb.CommonResponse()),
        dynamic_metadata=metadata,
    )


def request_body_answer(common: pb.CommonResponse | None = None,
                        metadata: struct_pb2.Struct | None = None) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common or pb.CommonResponse()),
        dynamic_metadata=metadata,
    )


def streamed_body(chunk: bytes, end: bool, response: bool = False) -> pb.ProcessingResponse:
    """FULL_DUPLEX_STREAMED: the processor sends the body on (Envoy holds none of it)."""
    body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(
        streamed_response=pb.StreamedBodyResponse(body=chunk, end_of_stream=end))))
    if response:
        return pb.ProcessingResponse(response_body=body)
    return pb.ProcessingResponse(request_body=body)


def immediate(status: int, message: str, code: str | None = None,
              retry_after: int | None = None) -> pb.ProcessingResponse:
    """An answer to the client in place of the upstream's, in OpenAI's error JSON (a 429 with
    ``Retry-After`` when ``retry_after`` is given)."""
    err_type = "invalid_request_error" if status < 500 else "service_unavailable"
    body = json.dumps(
        {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    ).encode()
    headers = [("content-type", b"application/json")]
    if retry_after is not None:
        headers.append(("retry-after", str(retry_after).encode()))
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
        headers=pb.HeaderMutation(set_headers=[
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v),
                                       append_action=_OVERWRITE) for k, v in headers]),
        body=body,
        details=f"pagoda_picker_{status}",
    ))
