"""One streaming generation on one engine (``services.protocol.engine_api``).

``open_stream`` posts the ``GenerateRequest`` and waits for the first frame, so that everything
that can go wrong *before the first token* surfaces there, where another engine may still take
over. After that, ``EngineStream.frames()`` yields frames until the ``finished`` one; a failure
then is an ``EngineStreamError``. ``close()`` drops the connection, which makes the engine abort
the request and free its KV blocks.

Each stream is one CLIENT span (``POST /internal/generate``), from the request until the
``finished`` frame, a failure or ``close()``; its context goes to the engine in ``traceparent``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import aiohttp
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.common import internal_auth, tracing
from services.protocol.engine_api import (
    CONTENT_TYPE,
    GENERATE_PATH,
    ErrorFrame,
    FinishedFrame,
    FrameDecoder,
    GenerateRequest,
    KVTransferFrame,
    MalformedFrame,
    StreamFrame,
    TokensFrame,
)
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

_MAX_ERROR_BODY = 64 * 1024


class EngineUnavailable(Exception):
    """The engine failed before its first frame; another engine may serve the request."""


class EngineStreamError(Exception):
    """The engine failed after its first frame: the request cannot be moved any more."""


class EngineStream:
    def __init__(
        self,
        engine_id: str,
        resp: aiohttp.ClientResponse,
        decoder: FrameDecoder,
        pending: list[StreamFrame],
        span: trace.Span = trace.INVALID_SPAN,
    ) -> None:
        self.engine_id = engine_id
        self._resp = resp
        self._decoder = decoder
        self._pending = pending
        self._done = False
        self._span = span

    async def frames(self) -> AsyncIterator[TokensFrame | FinishedFrame | KVTransferFrame]:
        """Frames up to and including the ``finished`` one. Raises EngineStreamError."""
        try:
            while True:
                while self._pending:
                    frame = self._pending.pop(0)
                    if isinstance(frame, ErrorFrame):
                        raise EngineStreamError(f"engine error: {frame.message[:200]}")
                    if isinstance(frame, FinishedFrame):
                        self._done = True
                        self._resp.release()
                        self._end_span(frame)
                        yield frame
                        return
                    yield frame
                try:
                    chunk = await self._resp.content.readany()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise EngineStreamError(
                        f"engine connection lost: {type(exc).__name__}"
                    ) from None
                if not chunk:
                    raise EngineStreamError("engine stream ended before the request finished")
                self._pending.extend(_decode(self._decoder, chunk, EngineStreamError))
        except EngineStreamError as exc:
            self._span.set_status(StatusCode.ERROR, str(exc))
            raise

    def close(self) -> None:
        """Ends the stream; unless it finished, the engine sees the disconnect and aborts."""
        if not self._done:
            self._done = True
            self._resp.close()
        self._end_span(None)

    def _end_span(self, finished: FinishedFrame | None) -> None:
        """Ends the span once: at the ``finished`` frame, or closed before it."""
        span, self._span = self._span, trace.INVALID_SPAN
        if not span.is_recording():
            return
        if finished is None:
            span.set_attribute("pagoda.outcome", "closed")  # a stop string, a failure, a cancel
        else:
            span.set_attributes({
                "pagoda.outcome": "finished",
                "gen_ai.response.finish_reasons": [finished.finish_reason],
                "gen_ai.usage.output_tokens": finished.completion_tokens,
            })
        span.end()


async def open_stream(
    session: aiohttp.ClientSession,
    engine_id: str,
    url: str,
    req: GenerateRequest,
    connect_timeout: float,
    tracer: trace.Tracer | None = None,
) -> EngineStream:
    """Starts ``req`` on the engine at ``url`` and returns once its first frame arrived.

    Raises EngineUnavailable (connection refused, 5xx, 429, stream closed or failed before any
    frame) or OpenAIError (the engine refused the request itself: a 4xx, passed on as is).
    """
    full_url = url.rstrip("/") + GENERATE_PATH
    tracer = tracer or tracing.get_tracer()
    if not tracing.is_enabled(tracer):
        return await _open(session, engine_id, full_url, req, connect_timeout, trace.INVALID_SPAN)
    span = tracer.start_span(
        "POST " + GENERATE_PATH,
        kind=SpanKind.CLIENT,
        attributes={"http.request.method": "POST", "url.full": full_url},
    )
    try:
        stream = await _open(session, engine_id, full_url, req, connect_timeout, span)
    except BaseException as exc:
        if not isinstance(exc, asyncio.CancelledError):
            span.set_status(StatusCode.ERROR, str(exc)[:200])
        span.end()
        raise
    return stream


async def _open(
    session: aiohttp.ClientSession,
    engine_id: str,
    url: str,
    req: GenerateRequest,
    connect_timeout: float,
    span: trace.Span,
) -> EngineStream:
    if span.is_recording():
        span.set_attributes({"pagoda.engine.id": engine_id, "pagoda.request_id": req.request_id})
    headers = {"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE}
    if span.get_span_context().is_valid:  # sampled out still propagates (sampled=0)
        tracing.inject_headers(headers, trace.set_span_in_context(span))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
    try:
        resp = await session.post(url, data=req.to_msgpack(), headers=headers, timeout=timeout)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EngineUnavailable(f"cannot reach engine: {type(exc).__name__}") from None
    span.set_attribute("http.response.status_code", resp.status)
    try:
        if resp.status != 200:
            await _raise_for_status(resp)
        decoder = FrameDecoder()
        pending: list[StreamFrame] = []
        while not pending:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineUnavailable(f"engine failed: {type(exc).__name__}") from None
            if not chunk:
                raise EngineUnavailable("engine closed the stream before any frame")
            pending = _decode(decoder, chunk, EngineUnavailable)
        first = pending[0]
        if isinstance(first, ErrorFrame):
            raise EngineUnavailable(f"engine error: {first.message[:200]}")
        return EngineStream(engine_id, resp, decoder, pending, span)
    except BaseException:
        resp.close()
        raise


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    status = resp.status
    if internal_auth.refused(status):  # another engine may hold the right token: retried
        raise EngineUnavailable("the engine refused the gateway's internal credential")
    if status >= 500 or status in (408, 429):
        raise EngineUnavailable(f"engine answered {status}")
    try:
        body = await resp.content.read(_MAX_ERROR_BODY)
        err = json.loads(body).get("error", {})
        message = str(err.get("message") or "the engine refused the request")
        param = err.get("param") if isinstance(err.get("param"), str) else None
    except (TimeoutError, aiohttp.ClientError, ValueError, AttributeError):
        message, param = "the engine refused the request", None
    raise OpenAIError(message, status=status if 400 <= status < 500 else 502, param=param)


def _decode(decoder: FrameDecoder, chunk: bytes, error: type[Exception]) -> list[StreamFrame]:
    try:
        return decoder.feed(chunk)
    except MalformedFrame as exc:
        raise error(str(exc)) from None
