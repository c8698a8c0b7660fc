"""The gateway's aiohttp app: ``create_app(config) -> web.Application``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``lora_admin``),
``POST /tokenize``, ``POST /detokenize``, ``GET /health`` (liveness), ``GET /ready`` (the router
answers; pinned to one engine with ``--engine-url``: that engine is serving), ``GET /metrics``,
``GET /metrics/engines`` (every live engine's metrics, federated), ``GET /openapi.json``,
``GET /version``.

Serve it with ``handler_cancellation=True`` (``__main__`` does): a client that disconnects then
cancels its handler, which closes the engine streams, so the engines abort and free KV blocks
even while nothing is being written to the client (a long prefill, a non-streaming request).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
from aiohttp import web

from services.common import internal_auth, tracing
from services.common.flow_control import FlowController, FlowMetrics
from services.common.http_errors import error_middleware
from services.gateway import api, lora_admin, tokenization
from services.gateway.admission import EngineWait
from services.gateway.auth import ApiKeyAuth, auth_middleware
from services.gateway.config import GatewayConfig
from services.gateway.engine_metrics import engine_metrics
from services.gateway.engine_watch import EngineWatch
from services.gateway.fingerprint import package_version
from services.gateway.generation import Upstreams
from services.gateway.local_engine import LocalEngine
from services.gateway.metrics import OTHER_MODEL, GatewayMetrics
from services.gateway.models import ModelRegistry, load_tokenizers
from services.gateway.openapi import openapi_document
from services.gateway.router_client import RouterClient, RouterUnavailable, Routing
from services.gateway.state import MODEL_LABEL, STATE, GatewayState
from services.protocol.openai import OpenAIError
from services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_METRICS = web.AppKey("metrics", GatewayMetrics)
_CONNECT_TIMEOUT_S = 5.0
_TRACED_PATHS = ("/v1/completions", "/v1/chat/completions")


def create_app(
    config: GatewayConfig, *, tokenizers: Mapping[str, Tokenizer] | None = None
) -> web.Application:
    """``tokenizers`` (served name -> Tokenizer) skips loading them from ``config.models``;
    the caller then owns them (tests share one across apps)."""
    if not config.models:
        raise ValueError("at least one model is required (--model NAME=HF_DIR)")
    if config.default_model is not None and config.default_model not in {
        m.name for m in config.models
    }:
        raise ValueError(f"--default-model {config.default_model!r} is not a served --model")
    if tokenizers is not None:
        missing = {m.name for m in config.models} - set(tokenizers)
        if missing:
            raise ValueError(f"no tokenizer given for models {sorted(missing)}")
    # What the gateway sends to the router and engines; checked now, before serving.
    internal = internal_auth.resolve(
        config.internal_token_file, config.insecure_no_internal_auth, "gateway")
    metrics = GatewayMetrics()
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[
            tracing.server_span_middleware(_TRACED_PATHS),  # outermost: sees the final status
            _metrics_middleware,
            error_middleware,
            auth_middleware(ApiKeyAuth((*config.api_keys, *config.admin_api_keys))),
        ],
    )
    app[_METRICS] = metrics

    async def resources(app: web.Application) -> AsyncIterator[None]:
        async with _resources(app, config, metrics, tokenizers, internal):
            yield

    app.cleanup_ctx.append(tracing.tracing_ctx(tracing.GATEWAY_SERVICE))  # first: ends last
    app.cleanup_ctx.append(resources)
    app.on_shutdown.append(_drain)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", _list_models)
    app.router.add_post("/tokenize", tokenization.tokenize)
    app.router.add_post("/detokenize", tokenization.detokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/metrics/engines", engine_metrics)
    app.router.add_get("/openapi.json", _openapi)
    app.router.add_get("/version", _version)
    lora_admin.add_routes(app)
    return app


@contextlib.asynccontextmanager
async def _resources(
    app: web.Application,
    config: GatewayConfig,
    metrics: GatewayMetrics,
    tokenizers: Mapping[str, Tokenizer] | None,
    internal: internal_auth.InternalCredential | None,
) -> AsyncIterator[None]:
    """Every long-lived resource: tokenizer thread, tokenizers, HTTP session, engines poller."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
    session: aiohttp.ClientSession | None = None
    poller: asyncio.Task[None] | None = None
    state: GatewayState | None = None
    try:
        loop = asyncio.get_running_loop()
        toks = tokenizers
        if toks is None:
            toks = await loop.run_in_executor(pool, load_tokenizers, config.models)
        models = ModelRegistry.build(config.models, toks, config.block_size, int(time.time()))
        # No pool cap: every streaming generation holds one engine connection. The session
        # only ever calls the router and the engines, so every call carries the internal
        # credential (never give it a URL outside the cluster's internal plane).
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        headers=internal_auth.client_headers(internal))
        tracer = app[tracing.TRACER]
        router: Routing = (
            LocalEngine(session, config.engine_url, config.router_timeout)
            if config.engine_url is not None
            else RouterClient(session, config.router_urls, config.router_timeout, tracer))
        watch = EngineWatch(session)
        # Pinned to one engine there is no other to retry on: its failure is the answer.
        retries = 0 if config.engine_url is not None else config.max_retries
        upstreams = Upstreams(
            session, router, metrics, retries, _CONNECT_TIMEOUT_S, tracer, watch,
            EngineWait(config.engine_wait_timeout, config.engine_wait_max_requests, metrics,
                       max_bytes=config.engine_wait_max_bytes,
                       max_tenant_bytes=config.engine_wait_max_tenant_bytes),
            config.pd_disaggregation, config.pd_min_prompt_tokens, config.pd_stream_kv,
        )
        flow = FlowController(config.flow_config(), router.loads,
                              FlowMetrics(metrics.registry, "pagoda_gateway"))
        state = GatewayState(config, models, router, upstreams, metrics, pool, flow)
        app[STATE] = state
        await _refresh_engines(state)
        poller = asyncio.create_task(_poll_engines(state))
        logger.info(
            "gateway ready models=%s router=%s engine=%s auth=%s",
            ",".join(models.models),
            config.router_url,
            config.engine_url,
            "on" if config.api_keys else "off",
        )
        yield
    finally:
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        if state is not None and state.upstreams.watch is not None:
            await state.upstreams.watch.aclose()
        if session is not None:
            await session.close()
        pool.shutdown(wait=False, cancel_futures=True)


async def _refresh_engines(state: GatewayState) -> bool:
    try:
        engines = await state.router.engines()
    except RouterUnavailable as exc:
        logger.warning("%s: engines unavailable: %s", state.router.name, exc)
        return False
    state.models.update(engines)
    if state.upstreams.watch is not None:
        # An engine we wait on that left the live set: hung, or draining? Probe it.
        state.upstreams.watch.check_gone(e.engine_id for e in engines)
    return True


async def _poll_engines(state: GatewayState) -> None:
    while True:
        await asyncio.sleep(state.config.engines_refresh)
        await _refresh_engines(state)


async def _drain(app: web.Application) -> None:
    """On SIGTERM (after the listener closed): let open generations finish for up to the
    grace period, then end the rest with an error (streams get an error event + [DONE])."""
    state = app.get(STATE)
    if state is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.shutdown_grace
    if state.generations:
        logger.info(
            "draining open=%d grace_s=%.1f", len(state.generations), state.config.shutdown_grace
        )
    while state.generations and loop.time() < deadline:
        await asyncio.sleep(0.05)
    for gen in list(state.generations):
        gen.abort(OpenAIError("the server is shutting down", status=503))


# -- small routes ---------------------------------------------------------------------------


async def _list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not await _refresh_engines(state):
        raise OpenAIError(f"{state.router.name} is unavailable", status=503)
    data = []
    for m in state.models.live():
        data.append(_model_card(m.name, m.created, m.name, None, m.max_model_len))
        # Its LoRA adapters, as vLLM lists them: parent the base model, root the path.
        data.extend(_model_card(a.name, m.created, a.path, m.name, m.max_model_len)
                    for a in sorted(m.adapters.values(), key=lambda a: a.name))
    return web.json_response({"object": "list", "data": data})


def _model_card(name: str, created: int, root: str, parent: str | None,
                max_model_len: int | None) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "pagoda",
            "root": root, "parent": parent, "max_model_len": max_model_len}


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not await _refresh_engines(state):
        raise OpenAIError(f"{state.router.name} is unavailable", status=503)
    return web.json_response(
        {"status": "ready", "live_models": [m.name for m in state.models.live()]}
    )


async def _metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[_METRICS].render()
    return web.Response(body=body, headers={"Content-Type": content_type})


async def _version(request: web.Request) -> web.Response:
    """vLLM's ``GET /version``: the server's version."""
    return web.json_response({"version": package_version()})


async def _openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


@web.middleware
async def _metrics_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    status = "cancelled"  # the client went away before a response
    try:
        resp = await handler(request)
        status = str(resp.status)
        return resp
    except web.HTTPException as exc:
        status = str(exc.status)
        raise
    except ConnectionError:
        raise  # the client went away mid-request: counted as "cancelled"
    except Exception:
        status = "500"
        raise
    finally:
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else "unmatched"
        model = request.get(MODEL_LABEL, OTHER_MODEL)
        request.app[_METRICS].requests.labels(endpoint, model, status).inc()
