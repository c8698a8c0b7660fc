"""Error responses in OpenAI's shape (``{"error": {message, type, param, code}}``, the
``OpenAIError`` contract) for every service, and a last-resort aiohttp middleware for the
internal services (engine, router): an exception a handler did not expect becomes a JSON 500,
logged with its traceback, instead of aiohttp's plain-text page. HTTP errors raised on purpose
(404, 405, 413...) keep their status and also get the JSON shape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


def json_error(status: int, message: str, param: str | None = None,
               type_: str | None = None) -> web.Response:
    return error_response(OpenAIError(message, status, param, type_))


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return error_response(OpenAIError(exc.reason, exc.status), headers=allow)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(500, "internal error")
