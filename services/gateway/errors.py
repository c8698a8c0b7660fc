"""Every failure leaves the gateway in OpenAI's error JSON: bad input is a 4xx, never a 500.

``error_middleware`` turns ``OpenAIError``, aiohttp's own HTTP exceptions (404 route, 405
method, 413 body) and anything unexpected (500, logged with its traceback but never with the
request body) into ``{"error": {...}}`` responses.

``read_json_body`` is the one place a request body is read: 413 past the size limit, 408 when
it does not arrive within the read timeout (a stalled or slowloris client), 400 when it cannot
be read (bad Content-Encoding or chunking) or is not UTF-8 JSON without lone surrogates.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from services.common.http_errors import error_response
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}
# A JSON escape of a UTF-16 surrogate: the body may hold a lone one, which no UTF-8 text can.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _from_http_exception(exc: web.HTTPException) -> OpenAIError:
    status = exc.status
    if status == 413:
        message = "request body is too large"
    elif status == 404:
        message = "no such route"
    else:
        message = exc.reason or "request failed"
    return OpenAIError(message, status=status, type_=_HTTP_TYPES.get(status))


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as err:
        return _closing(request, error_response(err))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like pass through untouched
        resp = error_response(_from_http_exception(exc), headers=_kept_headers(exc))
        return _closing(request, resp)
    except ConnectionError:
        raise  # the client has gone: there is no one to answer
    except Exception:
        logger.exception("unhandled error method=%s path=%s", request.method, request.path)
        return _closing(request, error_response(OpenAIError("internal server error", status=500)))


def _closing(request: web.Request, resp: web.Response) -> web.Response:
    """An error answered before the body was read to its end (too large, too slow, undecodable,
    refused before reading) says ``Connection: close``: aiohttp only drains the rest of the body
    for a while, or drops the connection at once if it cannot be decoded, so a client must not
    send its next request on it."""
    if request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp


def _kept_headers(exc: web.HTTPException) -> dict[str, str]:
    keep = ("Allow", "WWW-Authenticate", "Retry-After")
    return {k: v for k, v in exc.headers.items() if k in keep}


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
