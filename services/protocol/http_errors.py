"""A last-resort aiohttp middleware for the internal services (engine, router): an exception
a handler did not expect becomes a JSON 500 in the shared error shape, logged with its
traceback, instead of aiohttp's plain-text page. HTTP errors raised on purpose (404, 405,
413...) keep their status and also get the JSON shape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(message: str, kind: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        return web.json_response(error_body(exc.reason, kind), status=exc.status,
                                 headers={k: v for k, v in exc.headers.items()
                                          if k.lower() == "allow"})
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return web.json_response(error_body("internal error", "server_error"), status=500)
