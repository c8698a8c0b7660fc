"""What an Envoy sends the endpoint picker, built with the same generated protos (xds-protos),
and a stream client over a real gRPC channel: the test side of the ext_proc protocol."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = ProcessingMode.BUFFERED
STREAMED = ProcessingMode.STREAMED


def headers(path: str = "/v1/chat/completions", *, key: str | None = None,
            subset: list[str] | None = None, mode: int | None = None,
            end_of_stream: bool = False) -> pb.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end_of_stream,
    ))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    if mode is not None:  # Envoy puts its body modes on the stream's first message
        msg.protocol_config.CopyFrom(pb.ProtocolConfiguration(
            request_body_mode=mode, response_body_mode=mode))
    return msg


def body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


def chunks(data: bytes, n: int) -> list[pb.ProcessingRequest]:
    size = -(-len(data) // n)
    parts = [data[i:i + size] for i in range(0, len(data), size)]
    return [body(p, i == len(parts) - 1) for i, p in enumerate(parts)]


def response_headers(served: str | None) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", value="200")])))
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        msg.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return msg


def chat_body(text: str, model: str, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": text}],
                       "max_tokens": 4, **extra}).encode()


def header_mutation(common: pb.CommonResponse) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def lb_metadata(resp: pb.ProcessingResponse) -> dict[str, Any]:
    return dict(resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields.items())


class Stream:
    """One ext_proc stream as Envoy drives it: write messages, read answers."""

    def __init__(self, call: Any) -> None:
        self.call = call

    async def send(self, *msgs: pb.ProcessingRequest) -> None:
        for m in msgs:
            await self.call.write(m)

    async def read(self, timeout: float = 10.0) -> pb.ProcessingResponse:
        answer = await asyncio.wait_for(self.call.read(), timeout)
        assert answer is not grpc.aio.EOF, "the picker ended the stream"
        return answer

    async def read_all(self, n: int) -> list[pb.ProcessingResponse]:
        return [await self.read() for _ in range(n)]


@asynccontextmanager
async def ext_proc_stub(port: int) -> AsyncIterator[pb_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.ExternalProcessorStub(channel)


@asynccontextmanager
async def stream(stub: pb_grpc.ExternalProcessorStub) -> AsyncIterator[Stream]:
    call = stub.Process()
    try:
        yield Stream(call)
    finally:
        call.cancel()


def only(answers: Iterable[pb.ProcessingResponse]) -> list[str]:
    return [a.WhichOneof("response") for a in answers]
