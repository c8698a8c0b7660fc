"""The router as a Gateway API endpoint picker: Envoy's ``ExternalProcessor`` service.

One gRPC stream is one HTTP request. The picker reads the request body (the OpenAI request),
picks engines with the same ``Router`` as ``/route`` and answers with the ordered endpoint list
(``ext_proc_messages``). The stream's life, by the body mode Envoy announces in
``protocol_config`` (absent: FULL_DUPLEX_STREAMED, what InferencePool gateways configure):

- headers with end_of_stream (no body): 400, an OpenAI request has a body.
- FULL_DUPLEX_STREAMED, or any mode with send_body_without_waiting_for_header_response: the
  headers' answer is deferred; chunks are held (bounded) until the body ends, then come the
  headers' answer carrying the pick, and the body's answers (full duplex: the body itself,
  sent on as streamed responses, since Envoy keeps none of it; otherwise one CONTINUE per
  chunk).
- otherwise (BUFFERED, STREAMED, BUFFERED_PARTIAL, waiting for the headers' answer): the
  headers are answered at once (CONTINUE) and the pick rides on the last body answer.
- response headers: the endpoint that served is read back (``x-gateway-destination-endpoint-
  served``); when a fallback served, the prompt's blocks are written back to it.
- response body: passed on (streamed responses in full duplex, CONTINUE otherwise), never held.

Bounds: a body past ``max_body_bytes`` is a 413 and is not buffered further; all streams
together hold at most ``max_buffered_bytes`` of bodies (past that a 503); the body must end
within ``body_timeout_s`` of the headers (else 408) and its pick take no longer (else 503); the
stream lives at most ``stream_timeout_s``; the server admits ``ext_proc_max_streams`` streams
at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry, Counter

from services.common.flow_control import FlowController, Shed
from services.protocol.messages import RouteRequest
from services.protocol.openai import OpenAIError
from services.router import ext_proc_messages as em
from services.router.index import IndexSnapshot
from services.router.pick_prompt import PickInput, PickRequest, PromptReader
from services.router.policies import Candidate
from services.router.routing import Admit, NoEngineError, Router

logger = logging.getLogger(__name__)
T = TypeVar("T")

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
_HEADERS = frozenset({":path", "authorization", "x-request-id"})
_CHUNK = 1 << 20  # a held body goes back to Envoy in pieces of at most this


@dataclass(frozen=True, slots=True)
class PickerLimits:
    max_body_bytes: int = 4 << 20
    body_timeout_s: float = 30.0
    stream_timeout_s: float = 3600.0
    endpoints: int = 3  # the pick and its fallbacks
    shed_waiting: int = 0  # 429 when every candidate has this many waiting (0: never)
    max_buffered_bytes: int = 256 << 20  # request bodies held by all streams together


class ByteBudget:
    """The bytes of request bodies all streams hold at once (one event loop: no lock), so
    ``max_streams`` bodies of ``max_body_bytes`` cannot add up to more than the router has."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n
        assert self.used >= 0, "a stream gave back more than it took"


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.answers = Counter(
            "pagoda_router_ext_proc_answers",
            "Endpoint-picker answers by HTTP status (200: endpoints picked)",
            ["status"], registry=registry,
        )
        self.served = Counter(
            "pagoda_router_ext_proc_served",
            "Responses by the endpoint Envoy reports as served: the pick, a fallback, "
            "or not reported",
            ["endpoint"], registry=registry,
        )


@dataclass(slots=True)
class Refusal(Exception):
    status: int
    message: str
    code: str | None = None
    retry_after: int | None = None  # seconds, for a 429


@dataclass(frozen=True, slots=True)
class Picked:
    endpoints: list[str]
    engine_ids: dict[str, str]  # endpoint -> engine id, for the served read-back
    route: RouteRequest
    # The choice's write-back to Redis, run once Envoy has its answer (Router.pick)
    settle: Callable[[], Awaitable[None]] | None = None
    priority: int = 0  # the request's (flow control counts it in flight until the stream ends)


class Picker:
    """Body in, endpoints out: the decision, with no stream state."""

    def __init__(self, router: Router, prompts: PromptReader, limits: PickerLimits,
                 flow: FlowController | None = None, target_port: int = 0) -> None:
        """``target_port``: the port of the endpoints answered for engines that advertise
        none of their own (0: each engine's own). Engines serve OpenAI on another port than
        their internal API (the chart's sidecar, the pool's targetPorts; serve's front per
        engine): Envoy must get that one, and the subset hint and the served read-back name
        it too."""
        self.router = router
        self.prompts = prompts
        self.limits = limits
        self.flow = flow  # queues while the model's engines are saturated (None: off)
        self.target_port = target_port

    def endpoint(self, c: Candidate) -> str:
        """An engine as Envoy names it: ``ip:port`` of the data path, the port its heartbeat
        advertises (``--openai-port``: on one machine each engine's front has its own), else
        ``target_port``, else its URL's."""
        return em.endpoint_of(c.url, c.openai_port or self.target_port)

    async def pick(self, given: PickInput, subset: frozenset[str] | None) -> Picked:
        """Raises Refusal; 503 when tokenizing or picking take longer than the body may. In
        between, flow control may hold the request (its own bounds: shedding, the stream's
        timeout) or shed it (429)."""
        req = await self._timed(self._read(given))
        if self.flow is not None:
            try:
                await self.flow.admit(req.route.model, req.tenant, req.priority)
            except Shed as shed:
                raise Refusal(429, shed.message, "overloaded", shed.retry_after) from None
        picked = await self._timed(self._pick(req.route, subset))
        return replace(picked, priority=req.priority)

    async def _timed(self, work: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                return await work
        except TimeoutError:
            raise Refusal(503, "the endpoint picker is overloaded", "overloaded") from None

    async def _read(self, given: PickInput) -> PickRequest:
        try:
            return await self.prompts.route_request(given)
        except OpenAIError as exc:
            raise Refusal(exc.status, exc.message, exc.code) from None
        except NoEngineError as exc:
            raise Refusal(503, exc.message, "no_engine") from None

    async def _pick(self, req: RouteRequest, subset: frozenset[str] | None) -> Picked:
        admit = None if subset is None else _admit(subset, self.endpoint)
        try:
            pick = await self.router.pick(req, admit, settle_later=True)
        except NoEngineError as exc:
            where = "" if subset is None else " in the subset hint"
            raise Refusal(503, f"{exc.message}{where}", "no_engine") from None
        ranked = pick.ranked[: self.limits.endpoints]
        if self._shed(pick.ranked):  # not sent anywhere: nothing to write back
            raise Refusal(429, "every engine of the model is saturated", "overloaded")
        endpoints = [self.endpoint(c) for c in ranked]
        return Picked(endpoints, {self.endpoint(c): c.engine_id for c in ranked}, req,
                      pick.settle)

    def _shed(self, candidates: list[Candidate]) -> bool:
        limit = self.limits.shed_waiting
        return limit > 0 and all(c.waiting + c.pending >= limit for c in candidates)

    def finished(self, picked: Picked) -> None:
        """The request's stream ended (its response, or Envoy gave up): flow control's place
        for it is free."""
        if self.flow is not None:
            self.flow.finished(picked.route.model, picked.priority)

    async def served(self, picked: Picked, endpoint: str | None) -> str:
        """Accounts for the endpoint that served: 'primary', 'fallback' or 'unreported'."""
        if endpoint is None or endpoint not in picked.engine_ids:
            return "unreported"
        if endpoint == picked.endpoints[0]:
            return "primary"
        # The prompt's KV now sits on the fallback: siblings should follow it there.
        req = picked.route
        await self.router.index.record_choice(
            req.model, picked.engine_ids[endpoint], req.block_hashes, IndexSnapshot([], [], False)
        )
        return "fallback"


def _admit(subset: frozenset[str], endpoint_of: Callable[[Candidate], str]) -> Admit:
    def admit(c: Candidate) -> bool:
        endpoint = endpoint_of(c)
        return endpoint in subset or endpoint.rpartition(":")[0].strip("[]") in subset

    return admit


@dataclass(slots=True)
class _Stream:
    """One request's state (see the module doc for the order of answers)."""

    picker: Picker
    limits: PickerLimits
    metrics: PickerMetrics
    budget: ByteBudget
    request_mode: int = FULL_DUPLEX
    response_mode: int = FULL_DUPLEX
    no_wait: bool = False
    configured: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    subset: frozenset[str] | None = None
    deferred: bool = False
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    held: int = 0  # bytes taken from the budget
    picked: Picked | None = None
    settled: bool = False  # the pick's write-back ran
    done: bool = False  # an immediate response ended the request

    @property
    def in_body(self) -> bool:
        return self.deferred and self.picked is None and not self.done

    async def on(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config") and not self.configured:
            cfg = msg.protocol_config
            self.request_mode = cfg.request_body_mode or FULL_DUPLEX
            self.response_mode = cfg.response_body_mode or FULL_DUPLEX
            self.no_wait = cfg.send_body_without_waiting_for_header_response
        self.configured = True
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._on_headers(msg)
        if kind == "request_body":
            return await self._on_body(msg.request_body)
        if kind == "request_trailers":
            out = await self._finish(by_trailers=True) if self.in_body else []
            return out + [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            return await self._on_response_headers(msg)
        if kind == "response_body":
            return [self._pass_response_body(msg.response_body)]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _on_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        self.headers = em.header_values(msg.request_headers.headers, _HEADERS)
        self.subset = em.subset_hint(msg)
        if msg.request_headers.end_of_stream:
            return [self.refuse(Refusal(400, "an OpenAI request needs a JSON body"))]
        if self.request_mode == FULL_DUPLEX or self.no_wait:
            self.deferred = True
            return []
        return [em.request_headers_answer()]

    async def _on_body(self, body: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self.done or self.picked is not None:
            return []  # Envoy has an answer; nothing more of this body is ours to judge
        self.size += len(body.body)
        if self.size > self.limits.max_body_bytes:
            self.release()
            return [self.refuse(Refusal(
                413, f"the request body is larger than {self.limits.max_body_bytes} bytes"))]
        if not self.budget.take(len(body.body)):
            self.release()
            return [self.refuse(Refusal(
                503, "the endpoint picker holds too many request bodies", "overloaded"))]
        self.held += len(body.body)
        self.chunks.append(body.body)
        if body.end_of_stream:
            return await self._finish(by_trailers=False)
        if self.deferred:
            return []  # held until the pick
        return [em.request_body_answer()]  # STREAMED: this chunk goes on now

    async def _finish(self, by_trailers: bool) -> list[pb.ProcessingResponse]:
        path = self.headers.get(":path", "").partition("?")[0]
        given = PickInput(path, b"".join(self.chunks), self.headers.get("authorization"),
                          self.headers.get("x-request-id"))
        try:
            self.picked = await self.picker.pick(given, self.subset)
        except Refusal as refusal:
            self.release()
            return [self.refuse(refusal)]
        self.metrics.answers.labels(status="200").inc()
        common, metadata = em.destination(self.picked.endpoints)
        if not self.deferred:
            return [em.request_body_answer(common, metadata)]
        out = [em.request_headers_answer(common, metadata)]
        if self.request_mode == FULL_DUPLEX:
            body = given.body
            pieces = [body[i:i + _CHUNK] for i in range(0, len(body), _CHUNK)] or [b""]
            out += [em.streamed_body(p, end=not by_trailers and i == len(pieces) - 1)
                    for i, p in enumerate(pieces)]
        else:
            out += [em.request_body_answer() for _ in self.chunks]
        self.release()
        return out

    def release(self) -> None:
        """Drops the held body and gives its bytes back (also when the stream ends early)."""
        self.chunks.clear()
        self.budget.give(self.held)
        self.held = 0

    async def _on_response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self.picked is not None:
            outcome = await self.picker.served(self.picked, em.served_endpoint(msg))
            self.metrics.served.labels(endpoint=outcome).inc()
        return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]

    def _pass_response_body(self, body: pb.HttpBody) -> pb.ProcessingResponse:
        if self.response_mode == FULL_DUPLEX:
            return em.streamed_body(body.body, body.end_of_stream, response=True)
        return pb.ProcessingResponse(response_body=pb.BodyResponse())

    def refuse(self, refusal: Refusal) -> pb.ProcessingResponse:
        self.done = True
        self.metrics.answers.labels(status=str(refusal.status)).inc()
        logger.info("picker refused status=%d reason=%s", refusal.status, refusal.message)
        return em.immediate(refusal.status, refusal.message, refusal.code, refusal.retry_after)


class ExtProcService(pb_grpc.ExternalProcessorServicer):
    def __init__(self, picker: Picker, metrics: PickerMetrics) -> None:
        self.picker = picker
        self.limits = picker.limits
        self.metrics = metrics
        self.budget = ByteBudget(picker.limits.max_buffered_bytes)

    async def Process(  # noqa: N802 -- the generated servicer's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        stream = _Stream(self.picker, self.limits, self.metrics, self.budget)
        try:
            async with asyncio.timeout(self.limits.stream_timeout_s):
                await self._serve(stream, request_iterator, context)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "ext_proc stream too long")
        finally:
            stream.release()  # Envoy gave up mid-body, or the stream timed out
            if stream.picked is not None:
                self.picker.finished(stream.picked)

    async def _serve(self, stream: _Stream, requests: AsyncIterator[pb.ProcessingRequest],
                     context: grpc.aio.ServicerContext) -> None:
        it = aiter(requests)
        body_deadline: float | None = None
        loop = asyncio.get_running_loop()
        while not stream.done:
            if stream.in_body and body_deadline is None:
                body_deadline = loop.time() + self.limits.body_timeout_s
            try:
                async with asyncio.timeout_at(body_deadline if stream.in_body else None):
                    msg = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                await context.write(stream.refuse(Refusal(
                    408, f"the request body did not arrive within {self.limits.body_timeout_s}s")))
                return
            for answer in await stream.on(msg):
                await context.write(answer)
            if stream.picked is not None and stream.picked.settle is not None \
                    and not stream.settled:
                stream.settled = True  # Envoy has the pick: now the write-back
                await stream.picked.settle()
