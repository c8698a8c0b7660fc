"""The engine's HTTP server: the internal streaming API, /health, /metrics, Redis heartbeats.

    python -m services.engine.server --port 8100 [--model PATH] [--redis-url redis://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.engine.config import EngineConfig
from services.engine.core_loop import EngineCore
from services.engine.engine import RequestUpdate
from services.engine.metrics import EngineMetrics
from services.engine.sampler import TokenLogprobs
from services.protocol import engine_api

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8100
    engine_id: str | None = None  # default: hostname-port
    advertise_url: str | None = None  # how gateways reach this engine; default http://host:port
    redis_url: str | None = None
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    drain_timeout_s: float = 30.0

    def resolved_engine_id(self) -> str:
        return self.engine_id or f"{socket.gethostname()}-{self.port}"

    def resolved_url(self) -> str:
        return self.advertise_url or f"http://{self.host}:{self.port}"


CORE = web.AppKey("core", EngineCore)
METRICS = web.AppKey("metrics", EngineMetrics)
SERVER_CONFIG = web.AppKey("server_config", ServerConfig)


def create_app(engine_config: EngineConfig, server_config: ServerConfig) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SERVER_CONFIG] = server_config
    app.cleanup_ctx.append(_engine_ctx(engine_config))
    app.router.add_post(engine_api.GENERATE_PATH, handle_generate)
    app.router.add_post(engine_api.ABORT_PATH, handle_abort)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    return app


def _engine_ctx(engine_config: EngineConfig):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        core = EngineCore(engine_config)
        app[CORE] = core
        name = engine_config.served_model_name or os.path.basename(
            (engine_config.model or "SmolLM2-135M-Instruct").rstrip("/")
        )
        app[METRICS] = EngineMetrics(name, lambda: core.stats)
        core.start(asyncio.get_running_loop())
        publisher = asyncio.create_task(_publish_loop(app))
        try:
            yield
        finally:
            publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await publisher
            await asyncio.to_thread(core.stop)

    return ctx


# -- handlers ---------------------------------------------------------------------------------


def _json_error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": None}}
    return web.json_response(body, status=status)


async def handle_health(request: web.Request) -> web.Response:
    core = request.app[CORE]
    if core.load_error is not None:
        return web.json_response({"status": "error", "error": str(core.load_error)}, status=503)
    if not core.is_ready:
        return web.json_response({"status": "loading"}, status=503)
    engine = core.engine
    return web.json_response({
        "status": "ok",
        "model": engine.model_name,
        "block_size": engine.config.block_size,
        "max_model_len": engine.max_model_len,
    })


async def handle_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_abort(request: web.Request) -> web.Response:
    try:
        body = json.loads(await request.read())
        rid = body["request_id"]
        if not isinstance(rid, str):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return _json_error(400, "body must be {\"request_id\": str}")
    request.app[CORE].abort(rid)
    return web.json_response({"aborted": rid})


async def handle_generate(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE]
    if not core.is_ready:
        return _json_error(503, "engine is not ready")
    try:
        req = engine_api.GenerateRequest.from_msgpack(await request.read())
        core.engine.check_request(req.prompt_token_ids, req.params)
    except ValueError as exc:
        return _json_error(400, str(exc))
    rid = f"{req.request_id}-{uuid.uuid4().hex[:8]}"  # unique even if a client reuses ids
    updates: asyncio.Queue = asyncio.Queue()
    core.submit(rid, req.prompt_token_ids, req.params, req.cache_salt, updates.put_nowait)
    first = await updates.get()
    if isinstance(first, Exception):
        return _json_error(400, str(first))
    resp = web.StreamResponse(headers={"Content-Type": engine_api.CONTENT_TYPE})
    await resp.prepare(request)
    finished = False
    try:
        finished = await _stream(request.app[METRICS], resp, first, updates)
    finally:
        if not finished:  # client went away, or we failed: free the KV blocks now
            core.abort(rid)
    return resp


async def _stream(
    metrics: EngineMetrics, resp: web.StreamResponse, first, updates: asyncio.Queue
) -> bool:
    start = time.monotonic()
    last = None
    first_frame = True
    item = first
    model = metrics.model_name
    while True:
        if isinstance(item, Exception):
            await resp.write(engine_api.error_frame(str(item)))
            return True
        now = time.monotonic()
        if item.new_token_ids:
            if last is None:
                metrics.ttft.labels(model).observe(now - start)
            else:
                metrics.itl.labels(model).observe(now - last)
            last = now
            cached = item.num_cached_tokens if first_frame else None
            first_frame = False
            await resp.write(
                engine_api.tokens_frame(item.new_token_ids, _logprobs(item.new_logprobs), cached)
            )
        if item.finished:
            metrics.e2e.labels(model).observe(now - start)
            metrics.observe_finished(item.num_prompt_tokens, item.num_output_tokens,
                                     item.finish_reason)
            await resp.write(_finished(item))
            await resp.write_eof()
            return True
        item = await updates.get()


def _finished(u: RequestUpdate) -> bytes:
    return engine_api.finished_frame(u.finish_reason, u.stop_reason, u.num_prompt_tokens,
                                     u.num_output_tokens, u.num_cached_tokens)


def _logprobs(lps: list[TokenLogprobs | None]) -> list | None:
    if not any(lp is not None for lp in lps):
        return None
    return [
        None if lp is None else
        {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
         "top": [[t, v] for t, v in lp.top]}
        for lp in lps
    ]


# -- Redis: heartbeats and KV events ---------------------------------------------------------


async def _publish_loop(app: web.Application) -> None:
    """Publishes heartbeats and KV events while the engine runs (no-op without Redis)."""
    cfg = app[SERVER_CONFIG]
    if not cfg.redis_url:
        return
    from services.engine.redis_publisher import EnginePublisher

    core = app[CORE]
    publisher = EnginePublisher(cfg, core)
    try:
        while True:
            await publisher.publish_once()
            await asyncio.sleep(cfg.heartbeat_interval_s)
    finally:
        await publisher.close()


# -- CLI --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m services.engine.server",
                                 description="Pagoda engine server")
    for cls in (EngineConfig, ServerConfig):
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type in ("bool",) or isinstance(f.default, bool):
                ap.add_argument(flag, type=_parse_bool, default=f.default,
                                help=f"(default: {f.default})")
            else:
                kind = _arg_type(f.type)
                ap.add_argument(flag, type=kind, default=f.default, help=f"(default: {f.default})")
    return ap


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {s!r}")


def _arg_type(annotation: str):
    if annotation.startswith("int"):
        return int
    if annotation.startswith("float"):
        return float
    return str


def main(argv: list[str] | None = None) -> None:
    args = vars(build_parser().parse_args(argv))
    engine_config = EngineConfig(**{f.name: args[f.name] for f in fields(EngineConfig)})
    server_config = ServerConfig(**{f.name: args[f.name] for f in fields(ServerConfig)})
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    app = create_app(engine_config, server_config)
    # handler_cancellation: a client that goes away cancels its handler at once (even during
    # prefill), and the handler's finally-block aborts the request and frees its KV blocks.
    web.run_app(app, host=server_config.host, port=server_config.port, print=None,
                shutdown_timeout=server_config.drain_timeout_s, handler_cancellation=True)


if __name__ == "__main__":
    main()
