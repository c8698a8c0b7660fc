"""The gateway's side of the router: ``POST /route`` (msgpack) and ``GET /engines``.

``/route`` takes a ``RouteRequest`` and answers a ``RouteResponse``
(``services.protocol.messages``); a 503 (no live engine of the model) or 409 (all of them
excluded) means no engine is left.

Several replicas may be given; see ``RouterClient``. ``Routing`` is what the rest of the
gateway asks of it; ``local_engine.LocalEngine`` answers the same without a router.

``/engines`` lists the live engines, as JSON or msgpack: either a list or ``{"engines": [...]}``
of maps with at least ``engine_id``, ``url``, ``model`` and ``block_size`` (an
``EngineHeartbeat``), optionally ``max_model_len``. Entries that lack those are skipped.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import msgpack
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.common import internal_auth, tracing
from services.common.flow_control import EngineLoad
from services.protocol.block_hash import HashAlgorithm
from services.protocol.messages import RouteRequest, RouteResponse
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

ROUTE_PATH = "/route"
ENGINES_PATH = "/engines"
MSGPACK = "application/msgpack"


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """A LoRA adapter an engine serves (from its heartbeat)."""

    name: str
    version: str
    path: str

    @classmethod
    def from_dict(cls, d: Any) -> AdapterInfo | None:
        if not isinstance(d, dict):
            return None
        name, version, path = d.get("name"), d.get("version"), d.get("path", "")
        if not (isinstance(name, str) and name and isinstance(version, str) and version
                and isinstance(path, str)):
            return None
        return cls(name, version, path)


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: str
    url: str
    model: str
    block_size: int
    max_model_len: int | None = None
    hash_algorithm: HashAlgorithm = HashAlgorithm.XXH3_128
    adapters: tuple[AdapterInfo, ...] = ()

    @classmethod
    def from_dict(cls, d: Any) -> EngineInfo | None:
        if not isinstance(d, dict):
            return None
        eid, url, model, bs = d.get("engine_id"), d.get("url"), d.get("model"), d.get("block_size")
        if not all(isinstance(v, str) and v for v in (eid, url, model)):
            return None
        if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0:
            return None
        mml = d.get("max_model_len")
        if not isinstance(mml, int) or isinstance(mml, bool) or mml <= 0:
            mml = None
        try:  # routers older than the field say nothing: the default algorithm
            algorithm = HashAlgorithm(d.get("hash_algorithm", HashAlgorithm.XXH3_128.value))
        except ValueError:
            return None
        raw = d.get("adapters")
        adapters = tuple(a for a in (AdapterInfo.from_dict(x) for x in raw) if a is not None) \
            if isinstance(raw, list) else ()
        return cls(eid, url, model, bs, mml, algorithm, adapters)


class RouterUnavailable(Exception):
    """The router could not be reached or answered garbage (pinned to one engine: that
    engine is not serving)."""


class Routing(Protocol):
    """What the gateway asks of whatever picks its engines: ``RouterClient`` (the router), or
    ``LocalEngine`` (one engine beside it, ``--engine-url``)."""

    name: str  # as messages name it: "the router", "the engine"

    async def route(self, req: RouteRequest) -> RouteResponse:
        """The engine for ``req``; OpenAIError 503 when none is left."""
        ...

    async def engines(self) -> list[EngineInfo]:
        """The live engines. Raises RouterUnavailable."""
        ...

    async def loads(self, model: str) -> Sequence[EngineLoad] | None:
        """Flow control's view of ``model``'s engines (None: unknown, no flow control)."""
        ...

    async def call_json(self, method: str, path: str, body: Any = None
                        ) -> tuple[int, dict[str, Any]]:
        """The adapter registry's answer. Raises RouterUnavailable."""
        ...


class _RouterDown(Exception):
    """One replica failed (unreachable, timed out, a 5xx that is not 'no engine')."""


class RouterClient:
    """Talks to one or more router replicas. Replicas agree (their state is in Redis), so any
    one can answer: calls start at the next replica in turn, and a replica that fails is
    skipped for ``down_for_s`` while the call moves on to the next one. A replica dying
    therefore costs no request, only one failed connection attempt."""

    name = "the router"

    def __init__(
        self,
        session: aiohttp.ClientSession,
        base_url: str | Sequence[str],
        timeout: float,
        tracer: trace.Tracer | None = None,
        down_for_s: float = 5.0,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self._bases = [u.rstrip("/") for part in urls for u in part.split(",") if u.strip()]
        if not self._bases:
            raise ValueError("RouterClient needs at least one router URL")
        self._down_until = [0.0] * len(self._bases)
        self._next = 0
        self._down_for_s = down_for_s
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._tracer = tracer or tracing.get_tracer()
        self._traced = tracing.is_enabled(self._tracer)

    def _order(self) -> list[int]:
        """Replica indexes to try: the healthy ones from the next in turn, then the ones
        marked down (in case all of them are, or one came back early)."""
        n = len(self._bases)
        start, self._next = self._next, (self._next + 1) % n
        order = [(start + i) % n for i in range(n)]
        now = time.monotonic()
        return [i for i in order if self._down_until[i] <= now] + [
            i for i in order if self._down_until[i] > now
        ]

    def _mark_down(self, i: int, why: str) -> None:
        if self._down_until[i] <= time.monotonic():
            logger.warning("router %s failed (%s); trying the next replica", self._bases[i], why)
        self._down_until[i] = time.monotonic() + self._down_for_s

    async def route(self, req: RouteRequest) -> RouteResponse:
        """The engine for ``req``. Raises OpenAIError 503 when none is left or every router
        replica is down (the request cannot be served either way)."""
        for i in self._order():
            try:
                return await self._route_traced(self._bases[i] + ROUTE_PATH, req)
            except _RouterDown as exc:
                self._mark_down(i, str(exc))
        raise OpenAIError("the router is unavailable", status=503)

    async def _route_traced(self, url: str, req: RouteRequest) -> RouteResponse:
        if not self._traced:
            return await self._route(url, req, trace.INVALID_SPAN)
        with self._tracer.start_as_current_span(
            "POST " + ROUTE_PATH,
            kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "url.full": url},
        ) as span:
            answer = await self._route(url, req, span)
            if span.is_recording():
                span.set_attributes({
                    "pagoda.engine.id": answer.engine_id,
                    "pagoda.router.matched_blocks": answer.matched_blocks,
                    "pagoda.router.reason": answer.reason,
                })
            return answer

    async def _route(self, url: str, req: RouteRequest, span: trace.Span) -> RouteResponse:
        headers = {"Content-Type": MSGPACK, "Accept": MSGPACK}
        if self._traced:
            tracing.inject_headers(headers)
        try:
            async with self._session.post(
                url, data=req.to_msgpack(), headers=headers, timeout=self._timeout
            ) as resp:
                body = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise _RouterDown(type(exc).__name__) from None
        span.set_attribute("http.response.status_code", status)
        if status in (404, 409, 503) and _says_no_engine(body):
            raise OpenAIError(
                f"no engine available for model {req.model!r}",
                status=503,
                code="no_engine_available",
            )
        if status != 200:
            raise _RouterDown(f"status {status}")
        try:
            return RouteResponse.from_msgpack(body)
        except ValueError as exc:
            raise _RouterDown(f"malformed RouteResponse: {exc}") from None

    async def call_json(self, method: str, path: str, body: Any = None
                        ) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of ``method path`` on the first replica that answers (the
        adapter registry). Raises RouterUnavailable when none does."""
        why = "no router"
        for i in self._order():
            try:
                async with self._session.request(method, self._bases[i] + path, json=body,
                                                 timeout=self._timeout) as resp:
                    data = await resp.json(content_type=None)
                    if (resp.status >= 500 and resp.status != 503) or internal_auth.refused(
                            resp.status):
                        raise RouterUnavailable(f"{path} answered {resp.status}")
                    return resp.status, data if isinstance(data, dict) else {}
            except (TimeoutError, aiohttp.ClientError, ValueError, RouterUnavailable) as exc:
                why = str(exc) or type(exc).__name__
                self._mark_down(i, why)
        raise RouterUnavailable(why)

    async def engines(self) -> list[EngineInfo]:
        """The live engines, from the first replica that answers. Raises RouterUnavailable."""
        rows = await self._engine_rows(None)
        return [e for e in (EngineInfo.from_dict(d) for d in rows) if e is not None]

    async def loads(self, model: str) -> list[EngineLoad]:
        """What each live engine of ``model`` reports (flow control's saturation test).
        Raises RouterUnavailable."""
        return [e for e in (_load_of(d) for d in await self._engine_rows(model))
                if e is not None]

    async def _engine_rows(self, model: str | None) -> list[Any]:
        why = "no router"
        for i in self._order():
            try:
                return await self._engines(self._bases[i], model)
            except RouterUnavailable as exc:
                why = str(exc)
                self._mark_down(i, why)
        raise RouterUnavailable(why)

    async def _engines(self, base: str, model: str | None) -> list[Any]:
        try:
            async with self._session.get(
                base + ENGINES_PATH,
                params=None if model is None else {"model": model},
                headers={"Accept": f"application/json, {MSGPACK}"},
                timeout=self._timeout,
            ) as resp:
                if resp.status != 200:
                    raise RouterUnavailable(f"/engines answered {resp.status}")
                body = await resp.read()
                ctype = resp.content_type
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise RouterUnavailable(type(exc).__name__) from None
        try:
            data = msgpack.unpackb(body, raw=False) if ctype == MSGPACK else json.loads(body)
        except Exception as exc:  # noqa: BLE001 -- json and msgpack raise many types
            raise RouterUnavailable(f"/engines body is malformed: {type(exc).__name__}") from None
        if isinstance(data, dict):
            data = data.get("engines")
        if not isinstance(data, list):
            raise RouterUnavailable("/engines must be a list or {'engines': [...]}")
        return data


def _load_of(d: Any) -> EngineLoad | None:
    """A row's load; None when a field is missing or malformed (that engine is not counted)."""
    if not isinstance(d, dict):
        return None
    waiting, pending, kv = d.get("waiting"), d.get("pending"), d.get("kv_usage")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
               for v in (waiting, pending)):
        return None
    if not isinstance(kv, int | float) or isinstance(kv, bool):
        return None
    return EngineLoad(waiting, pending, float(kv))


def _says_no_engine(body: bytes) -> bool:
    """Whether a 404/409/503 from /route is the router's own "no engine" answer (a JSON
    ``{"error": ...}``), not a proxy's or a dying replica's error page: only the latter is
    worth asking another replica."""
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict)
