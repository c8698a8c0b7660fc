"""The gateway's request body reader; its errors leave through the one error middleware
(``services.common.http_errors.error_middleware``) in OpenAI's error JSON.

``read_json_body`` is the one place a request body is read: 413 past the size limit, 408 when
it does not arrive within the read timeout (a stalled or slowloris client), 400 when it cannot
be read (bad Content-Encoding or chunking) or is not UTF-8 JSON without lone surrogates.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.protocol.openai import OpenAIError

# A JSON escape of a UTF-16 surrogate: the body may hold a lone one, which no UTF-8 text can.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_json_body(request: web.Request, limit: int, timeout: float) -> Any:
    """The request body as JSON: 413 past ``limit`` bytes (the app's ``client_max_size``, which
    aiohttp enforces while reading), 408 when the whole body has not arrived ``timeout`` seconds
    after the handler began reading it, 400 for a body that cannot be read or is not JSON."""
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(
            f"request body is too large ({request.content_length} > {limit} bytes)", status=413
        )
    try:
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise OpenAIError(
            f"the request body did not arrive within {timeout:g} seconds",
            status=408,
            code="request_timeout",
        ) from None
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(f"request body is too large (limit {limit} bytes)", status=413) from None
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # bad gzip data, chunking
        raise OpenAIError(f"the request body could not be read: {_payload_reason(exc)}") from None
    if not raw:
        raise OpenAIError("the request body must be a JSON object")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise OpenAIError(f"the request body is not valid UTF-8: {_short(exc)}") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise OpenAIError(f"the request body is not valid JSON: {_short(exc)}") from None
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise OpenAIError(
            "the request body holds a string with a lone UTF-16 surrogate escape (such as "
            "\\ud800), which is not valid Unicode text"
        )
    return body


def _payload_reason(exc: Exception) -> str:
    """What aiohttp's parser said of a body it could not decode (it wraps its own error)."""
    cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
    if isinstance(cause, HttpProcessingError) and cause.message.strip():
        return cause.message.strip().splitlines()[0][:200]
    return _short(exc)


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:  # iterative: the body may nest as deep as the JSON parser allowed
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
