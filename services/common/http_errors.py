"""Error responses in OpenAI's shape (``{"error": {message, type, param, code}}``, the
``OpenAIError`` contract), and the one error middleware of every service (gateway, router,
engine): whatever a handler raises leaves as that JSON, never as aiohttp's plain-text page.

``error_middleware`` answers ``OpenAIError`` with its own status and fields (and its
``retry_after`` as ``Retry-After``); aiohttp's HTTP
exceptions raised on purpose (404 route, 405 method, 413 body...) keep their status (and their
``Allow``, ``WWW-Authenticate``, ``Retry-After`` headers); anything unexpected is a 500, logged
with its traceback but never with the request body. A client that went away gets nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_KEPT_HEADERS = ("Allow", "WWW-Authenticate", "Retry-After")


def error_response(err: OpenAIError, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


def json_error(status: int, message: str, param: str | None = None,
               type_: str | None = None) -> web.Response:
    return error_response(OpenAIError(message, status, param, type_))


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OpenAIError as err:
        retry = {} if err.retry_after is None else {"Retry-After": str(err.retry_after)}
        return _closing(request, error_response(err, headers=retry))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise  # redirects and the like pass through untouched
        kept = {k: v for k, v in exc.headers.items() if k in _KEPT_HEADERS}
        return _closing(request, error_response(_from_http_exception(exc), headers=kept))
    except ConnectionError:
        raise  # the client has gone: there is no one to answer
    except Exception:
        logger.exception("unhandled error method=%s path=%s", request.method, request.path)
        return _closing(request, error_response(OpenAIError("internal server error", 500)))


def _from_http_exception(exc: web.HTTPException) -> OpenAIError:
    if exc.status == 413:
        message = "request body is too large"
    elif exc.status == 404:
        message = "no such route"
    else:
        message = exc.reason or "request failed"
    return OpenAIError(message, status=exc.status)


def _closing(request: web.Request, resp: web.Response) -> web.Response:
    """An error answered before the body was read to its end (too large, too slow, undecodable,
    refused before reading) says ``Connection: close``: aiohttp only drains the rest of the body
    for a while, or drops the connection at once if it cannot be decoded, so a client must not
    send its next request on it."""
    if request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp
