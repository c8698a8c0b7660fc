"""The one error middleware (services.common.http_errors): whatever a handler raises leaves in
OpenAI's error JSON with the right status, and the gateway, the router and the engine all use
it (their own tests check the answers end to end: tests/gateway/test_errors.py,
tests/router/test_route_validation.py, tests/engine/test_server.py)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.common.http_errors import error_middleware
from services.protocol.openai import OpenAIError

SECRET = "do-not-log-this-prompt"


async def _boom(request: web.Request) -> web.Response:
    await request.read()
    raise RuntimeError("bug")


async def _refuse(request: web.Request) -> web.Response:
    raise OpenAIError("too many", status=429, param="n", code="busy")


async def _read(request: web.Request) -> web.Response:
    return web.Response(body=await request.read())


def _app() -> web.Application:
    app = web.Application(client_max_size=64, middlewares=[error_middleware])
    app.router.add_post("/boom", _boom)
    app.router.add_get("/refuse", _refuse)
    app.router.add_post("/read", _read)
    return app


async def _call(method: str, path: str, **kwargs: Any) -> tuple[int, dict, dict]:
    async with TestClient(TestServer(_app())) as client:
        resp = await client.request(method, path, **kwargs)
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "error"),
    [
        ("GET", "/nope", {}, 404,
         {"message": "no such route", "type": "not_found_error", "param": None, "code": None}),
        ("GET", "/read", {}, 405, {"message": "Method Not Allowed",
                                   "type": "invalid_request_error", "param": None, "code": None}),
        ("POST", "/read", {"data": b"x" * 100}, 413, {
            "message": "request body is too large", "type": "invalid_request_error",
            "param": None, "code": None}),
        ("GET", "/refuse", {}, 429,
         {"message": "too many", "type": "rate_limit_error", "param": "n", "code": "busy"}),
        ("POST", "/boom", {"data": SECRET}, 500, {"message": "internal server error",
                                                 "type": "server_error", "param": None,
                                                 "code": None}),
    ],
)
def test_every_failure_is_openai_json(
    caplog: pytest.LogCaptureFixture, method: str, path: str, kwargs: dict, status: int,
    error: dict,
) -> None:
    with caplog.at_level(logging.ERROR, logger="services.common.http_errors"):
        got, body, headers = asyncio.run(_call(method, path, **kwargs))
    assert (got, body) == (status, {"error": error})
    if status == 405:
        assert headers["Allow"] == "POST"
    if status == 500:  # logged with its traceback, never with the body
        assert "RuntimeError: bug" in caplog.text and SECRET not in caplog.text


def test_the_three_services_use_it(fast_model_dir) -> None:
    """Building the apps starts nothing (engines and tokenizers load in cleanup contexts)."""
    from services.engine.config import EngineConfig
    from services.engine.serving.server import create_app as engine_app
    from services.engine.serving.server_config import ServerConfig
    from services.gateway.config import GatewayConfig, ModelSpec
    from services.gateway.server import create_app as gateway_app
    from services.router.config import RouterConfig
    from services.router.server import create_app as router_app

    apps = [
        gateway_app(GatewayConfig(models=(ModelSpec("m", str(fast_model_dir)),))),
        router_app(RouterConfig()),
        engine_app(EngineConfig(model=str(fast_model_dir)), ServerConfig()),
    ]
    for app in apps:
        assert error_middleware in app.middlewares
