"""Every failure leaves the gateway in OpenAI's error JSON: bad input is a 4xx, never a 500.

``error_middleware`` is the outermost middleware: it turns ``OpenAIError``, aiohttp's own HTTP
exceptions (404 route, 405 method, 413 body) and anything unexpected (500, logged with its
traceback but never with the request body) into ``{"error": {...}}`` responses.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

_HTTP_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


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
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like pass through untouched
        return error_response(_from_http_exception(exc), headers=_kept_headers(exc))
    except Exception:
        logger.exception("unhandled error method=%s path=%s", request.method, request.path)
        return error_response(OpenAIError("internal server error", status=500))


def _kept_headers(exc: web.HTTPException) -> dict[str, str]:
    keep = ("Allow", "WWW-Authenticate", "Retry-After")
    return {k: v for k, v in exc.headers.items() if k in keep}


async def read_json_body(request: web.Request, limit: int) -> Any:
    """The request body as JSON: 413 past ``limit`` bytes (the app's ``client_max_size``, which
    aiohttp enforces while reading), 400 for anything that is not JSON."""
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(
            f"request body is too large ({request.content_length} > {limit} bytes)", status=413
        )
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise OpenAIError(f"request body is too large (limit {limit} bytes)", status=413) from None
    if not raw:
        raise OpenAIError("the request body must be a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise OpenAIError(f"the request body is not valid JSON: {_short(exc)}") from None


def _short(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
