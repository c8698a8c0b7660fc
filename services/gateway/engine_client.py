"""One streaming generation on one engine (``services.protocol.engine_api``).

``open_stream`` posts the ``GenerateRequest`` and waits for the first frame, so that everything
that can go wrong *before the first token* surfaces there, where another engine may still take
over. After that, ``EngineStream.frames()`` yields frames until the ``finished`` one; a failure
then is an ``EngineStreamError``. ``close()`` drops the connection, which makes the engine abort
the request and free its KV blocks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from services.protocol.engine_api import CONTENT_TYPE, GENERATE_PATH, FrameDecoder, GenerateRequest
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
        pending: list[dict[str, Any]],
    ) -> None:
        self.engine_id = engine_id
        self._resp = resp
        self._decoder = decoder
        self._pending = pending
        self._done = False

    async def frames(self) -> AsyncIterator[dict[str, Any]]:
        """Frames up to and including the ``finished`` one. Raises EngineStreamError."""
        while True:
            while self._pending:
                frame = self._pending.pop(0)
                _check_frame(frame)
                if frame["type"] == "error":
                    raise EngineStreamError(f"engine error: {str(frame.get('message'))[:200]}")
                if frame["type"] == "finished":
                    self._done = True
                    self._resp.release()
                    yield frame
                    return
                yield frame
            try:
                chunk = await self._resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineStreamError(f"engine connection lost: {type(exc).__name__}") from None
            if not chunk:
                raise EngineStreamError("engine stream ended before the request finished")
            self._pending.extend(_decode(self._decoder, chunk, EngineStreamError))

    def close(self) -> None:
        """Ends the stream; unless it finished, the engine sees the disconnect and aborts."""
        if not self._done:
            self._done = True
            self._resp.close()


async def open_stream(
    session: aiohttp.ClientSession,
    engine_id: str,
    url: str,
    req: GenerateRequest,
    connect_timeout: float,
) -> EngineStream:
    """Starts ``req`` on the engine at ``url`` and returns once its first frame arrived.

    Raises EngineUnavailable (connection refused, 5xx, 429, stream closed or failed before any
    frame) or OpenAIError (the engine refused the request itself: a 4xx, passed on as is).
    """
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout)
    try:
        resp = await session.post(
            url.rstrip("/") + GENERATE_PATH,
            data=req.to_msgpack(),
            headers={"Content-Type": CONTENT_TYPE, "Accept": CONTENT_TYPE},
            timeout=timeout,
        )
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise EngineUnavailable(f"cannot reach engine: {type(exc).__name__}") from None
    try:
        if resp.status != 200:
            await _raise_for_status(resp)
        decoder = FrameDecoder()
        pending: list[dict[str, Any]] = []
        while not pending:
            try:
                chunk = await resp.content.readany()
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineUnavailable(f"engine failed: {type(exc).__name__}") from None
            if not chunk:
                raise EngineUnavailable("engine closed the stream before any frame")
            pending = _decode(decoder, chunk, EngineUnavailable)
        first = pending[0]
        _check_frame(first, EngineUnavailable)
        if first["type"] == "error":
            raise EngineUnavailable(f"engine error: {str(first.get('message'))[:200]}")
        return EngineStream(engine_id, resp, decoder, pending)
    except BaseException:
        resp.close()
        raise


async def _raise_for_status(resp: aiohttp.ClientResponse) -> None:
    status = resp.status
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


def _decode(decoder: FrameDecoder, chunk: bytes, error: type[Exception]) -> list[dict[str, Any]]:
    try:
        return decoder.feed(chunk)
    except Exception as exc:  # noqa: BLE001 -- msgpack raises several unrelated types
        raise error(f"malformed engine frame: {type(exc).__name__}") from None


def _check_frame(frame: Any, error: type[Exception] = EngineStreamError) -> None:
    if not isinstance(frame, dict) or frame.get("type") not in ("tokens", "finished", "error"):
        raise error("malformed engine frame")
    if frame["type"] == "tokens":
        ids = frame.get("token_ids")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
        ):
            raise error("malformed engine frame: token_ids")
