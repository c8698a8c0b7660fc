"""Fake engine and router on 127.0.0.1:<random port>, speaking exactly the real contracts
(``services.protocol.engine_api`` and the router's ``/route`` + ``/engines``), so the gateway
can be tested before the real services exist and failures can be staged at will.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from services.protocol.engine_api import (
    CONTENT_TYPE,
    GENERATE_PATH,
    ErrorFrame,
    FinishedFrame,
    GenerateRequest,
    TokenLogprobs,
    TokensFrame,
)
from services.protocol.lora_api import ADAPTERS_PATH
from services.protocol.messages import RouteRequest, RouteResponse


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Starts ``app`` on a free port; returns the runner and its base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


def dead_url() -> str:
    """A URL nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- engine ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EngineBehaviour:
    # ok | http500 | http400 | close_before_frame | error_first | error_mid | drop_mid | hang
    mode: str = "ok"
    script: list[int] | None = None  # tokens to generate; None = echo the prompt's tokens
    tokens_per_frame: int = 1
    delay: float = 0.0  # seconds before each tokens frame
    fail_after: int = 2  # frames sent before error_mid / drop_mid
    cached_tokens: int = 0
    cached_in_tokens_frames: bool = False  # also report cached_tokens on tokens frames


class FakeEngine:
    """Echoes deterministic tokens; records requests, aborts (stream closed early) and
    finished requests."""

    def __init__(self, engine_id: str, behaviour: EngineBehaviour | None = None) -> None:
        self.engine_id = engine_id
        self.behaviour = behaviour or EngineBehaviour()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.finished: list[str] = []
        self.abort_seen = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None
        # What GET /health answers, as the engine's (a pinned gateway reads it): 200 with the
        # model once loaded, 503 while loading or draining.
        self.health_status = 200
        self.model = "smol"
        # What GET /internal/lora/adapters answers (AdapterStatus maps); None: a 404, as an
        # engine older than the route.
        self.adapters: list[dict] | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post(GENERATE_PATH, self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get(ADAPTERS_PATH, self._adapters)
        self._runner, self.url = await serve(app)
        return self.url

    async def _health(self, request: web.Request) -> web.Response:
        if self.health_status != 200:
            return web.json_response({"status": "loading"}, status=self.health_status)
        return web.json_response({"status": "ok", "model": self.model, "block_size": 16,
                                  "max_model_len": 2048})

    async def _adapters(self, request: web.Request) -> web.Response:
        if self.adapters is None:
            return web.json_response({"error": {"message": "not found"}}, status=404)
        return web.json_response({"adapters": self.adapters})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        req = GenerateRequest.from_msgpack(await request.read())
        self.requests.append(req)
        b = self.behaviour
        if b.mode == "http500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if b.mode == "http400":
            return web.json_response(
                {"error": {"message": "prompt too long for this engine", "param": "prompt"}},
                status=400,
            )
        resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        await resp.prepare(request)
        try:
            return await self._stream(request, resp, req)
        except (ConnectionError, asyncio.CancelledError):
            self._record_abort(req.request_id)
            raise

    async def _stream(
        self, request: web.Request, resp: web.StreamResponse, req: GenerateRequest
    ) -> web.StreamResponse:
        b = self.behaviour
        if b.mode == "close_before_frame":
            request.transport.close()
            return resp
        if b.mode == "error_first":
            await resp.write(ErrorFrame("engine exploded").to_msgpack())
            return resp
        if b.mode == "hang":
            await asyncio.sleep(3600)
        script = list(b.script if b.script is not None else req.prompt_token_ids)
        limit = req.params.max_tokens
        out = script if limit is None else script[:limit]
        sent = 0
        for frame_no, start in enumerate(range(0, len(out), b.tokens_per_frame)):
            if frame_no == b.fail_after and b.mode == "error_mid":
                await resp.write(ErrorFrame("engine exploded mid-stream").to_msgpack())
                return resp
            if frame_no == b.fail_after and b.mode == "drop_mid":
                request.transport.close()
                return resp
            if b.delay:
                await asyncio.sleep(b.delay)
            ids = out[start : start + b.tokens_per_frame]
            await resp.write(self._tokens_frame(ids, req))
            sent += len(ids)
        reason = "length" if limit is not None and len(script) > limit else "stop"
        await resp.write(
            FinishedFrame(reason, None, len(req.prompt_token_ids), sent,
                          b.cached_tokens).to_msgpack()
        )
        self.finished.append(req.request_id)
        await resp.write_eof()
        return resp

    def _tokens_frame(self, ids: list[int], req: GenerateRequest) -> bytes:
        n = req.params.logprobs
        lps = None
        if n is not None:
            lps = [
                TokenLogprobs(t, -0.5, 1,
                              [(t, -0.5)] + [((t + k) % 1000, -1.0 - k) for k in range(1, n)])
                for t in ids
            ]
        cached = self.behaviour.cached_tokens if self.behaviour.cached_in_tokens_frames else None
        return TokensFrame(ids, lps, cached).to_msgpack()

    def _record_abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.abort_seen.set()


# -- router ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EngineEntry:
    engine_id: str
    url: str
    model: str
    block_size: int = 16
    max_model_len: int | None = None
    hash_algorithm: str = "xxh3_128"

    def heartbeat(self) -> dict[str, Any]:
        d = {
            "engine_id": self.engine_id,
            "url": self.url,
            "model": self.model,
            "block_size": self.block_size,
            "hash_algorithm": self.hash_algorithm,
            "running": 0,
            "waiting": 0,
            "kv_usage": 0.0,
            "free_blocks": 100,
            "total_blocks": 100,
            "timestamp": 0.0,
        }
        if self.max_model_len is not None:
            d["max_model_len"] = self.max_model_len
        return d


@dataclass(slots=True)
class FakeRouter:
    """Picks the first engine of the model that is not excluded, in list order."""

    engines: list[EngineEntry] = field(default_factory=list)
    requests: list[RouteRequest] = field(default_factory=list)
    url: str = ""
    down: bool = False  # /engines and /route answer 500
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/route", self._route)
        app.router.add_get("/engines", self._engines)
        self._runner, self.url = await serve(app)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _route(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": {"message": "down"}}, status=500)
        req = RouteRequest.from_msgpack(await request.read())
        self.requests.append(req)
        for e in self.engines:
            if e.model == req.model and e.engine_id not in req.exclude:
                resp = RouteResponse(e.engine_id, e.url, 0, "first", "fake")
                return web.Response(body=resp.to_msgpack(), content_type="application/msgpack")
        return web.json_response(
            {"error": {"message": f"no engine for {req.model}", "type": "server_error"}},
            status=503,
        )

    async def _engines(self, request: web.Request) -> web.Response:
        if self.down:
            return web.json_response({"error": {"message": "down"}}, status=500)
        return web.json_response({"engines": [e.heartbeat() for e in self.engines]})
