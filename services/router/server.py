"""The router's HTTP API (aiohttp).

POST /route     msgpack RouteRequest -> msgpack RouteResponse
                400 JSON: bad body (``param`` names the field); 413 JSON: body too large;
                503 JSON: no live engine serves the model;
                409 JSON: live engines exist but the request excluded them all
GET  /engines   JSON: live engines with their load (?model=NAME for one model)
GET  /health    JSON liveness, with Redis and discovery state (always 200)
GET  /ready     200 once engine discovery has synced, else 503 (Redis does not gate it:
                without Redis the router still routes, by load)
GET  /metrics   Prometheus text, with the per-model demand (``services.router.demand``)
GET/POST/DELETE /adapters   the registry of runtime-loaded LoRA adapters (router.adapters)
gRPC on --ext-proc-port     Envoy ext_proc: the Gateway API endpoint picker (router.ext_proc)

Every route but /health, /ready and /metrics requires the internal credential
(``services.common.internal_auth``): a 401 JSON without it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common import internal_auth, tracing
from services.common.http_errors import error_middleware, json_error
from services.common.lora_registry import AdapterRegistry
from services.common.redis_index import KVIndexReader, connect, redact_url
from services.protocol.messages import RouteRequest
from services.protocol.redis_schema import RedisKeys
from services.protocol.wire import BadRequest
from services.router import adapters
from services.router.config import RouterConfig
from services.router.deletion_cost import DeletionCost, HitWindow, PodAnnotator, PrefixHits
from services.router.demand import Demand
from services.router.discovery import (
    Discovery,
    KubernetesDiscovery,
    OpenDiscovery,
    StaticDiscovery,
    default_api_client,
)
from services.router.ext_proc import PickerMetrics
from services.router.ext_proc_server import EXT_PROC_PORT_KEY, serve_ext_proc
from services.router.index import RouterIndex
from services.router.metrics import RouterMetrics
from services.router.policies import make_policy
from services.router.routing import NoEngineError, RouteObserver, Router, status_dict

logger = logging.getLogger(__name__)

MSGPACK = "application/msgpack"
MAX_BODY_BYTES = 8 * 1024 * 1024  # ~450k block hashes: prompts of several million tokens

CONFIG_KEY = web.AppKey("config", RouterConfig)
METRICS_KEY = web.AppKey("metrics", RouterMetrics)
ROUTER_KEY = web.AppKey("router", Router)
DEMAND_KEY = web.AppKey("demand", Demand)
DELETION_COST_KEY = web.AppKey("deletion_cost", DeletionCost)


def create_app(config: RouterConfig) -> web.Application:
    """Raises ``internal_auth.MissingCredential`` without an internal credential (unless the
    config opts out): the routes are never served open by accident."""
    credential = internal_auth.resolve(
        config.internal_token_file, config.insecure_no_internal_auth, "router")
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[error_middleware, tracing.server_span_middleware(["/route"]),
                     *internal_auth.middlewares(credential)],
    )
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = RouterMetrics()
    app.cleanup_ctx.append(tracing.tracing_ctx(tracing.ROUTER_SERVICE))  # first: torn down last
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/route", handle_route)
    app.router.add_get("/engines", handle_engines)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/ready", handle_ready)
    app.router.add_get("/metrics", handle_metrics)
    adapters.add_routes(app)  # the LoRA adapter registry
    if config.ext_proc_port:
        app.cleanup_ctx.append(_ext_proc)  # after _lifecycle: the picker stops first
    return app


def build_discovery(config: RouterConfig, metrics: RouterMetrics) -> Discovery:
    if config.k8s_service:
        api_url = config.k8s_api_url
        return KubernetesDiscovery(
            config.k8s_service,
            config.k8s_namespace,
            port_name=config.k8s_port_name,
            scheme=config.k8s_scheme,
            api_client_factory=lambda: default_api_client(api_url),
            backoff_max_s=config.k8s_backoff_max_s,
            on_restart=metrics.discovery_restarts.inc,
        )
    if config.engines:
        return StaticDiscovery(config.engines)
    return OpenDiscovery()


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Every long-lived resource: the Redis pool, the discovery watch and (with Kubernetes
    discovery) the pod-deletion-cost task."""
    config = app[CONFIG_KEY]
    metrics = app[METRICS_KEY]
    redis = connect(config.redis_url, timeout_s=config.redis_timeout_s)
    keys = RedisKeys(config.redis_namespace)
    app[adapters.REGISTRY] = AdapterRegistry(redis, keys)
    reader = KVIndexReader(
        redis,
        keys,
        max_blocks_per_engine=config.max_blocks_per_engine,
    )
    index = RouterIndex(
        reader,
        metrics,
        provisional_ttl_s=config.provisional_ttl_s,
        pending_ttl_s=config.pending_ttl_s,
        retry_s=config.redis_retry_s,
        fallback_max_age_s=config.fallback_max_age_s,
    )
    discovery = build_discovery(config, metrics)
    demand = app[DEMAND_KEY] = Demand(redis, keys, index, metrics)
    observers: list[RouteObserver] = [demand]
    deletion_cost = None
    if config.deletion_cost and isinstance(discovery, KubernetesDiscovery):
        hits = PrefixHits()
        observers.append(hits)
        api_url = config.k8s_api_url
        deletion_cost = app[DELETION_COST_KEY] = DeletionCost(
            hits, HitWindow(redis, keys, config.deletion_cost_window_s),
            PodAnnotator(lambda: default_api_client(api_url), discovery.namespace),
            discovery, index, redis, keys, config.deletion_cost_interval_s,
        )
    app[ROUTER_KEY] = Router(
        index, discovery, make_policy(config.policy, config), metrics, app[tracing.TRACER],
        observers=observers,
    )
    await discovery.start()
    if deletion_cost is not None:
        await deletion_cost.start()
    logger.info(
        "router started policy=%s redis=%s discovery=%s",
        config.policy.value,
        redact_url(config.redis_url),
        type(discovery).__name__,
    )
    try:
        yield
    finally:
        if deletion_cost is not None:
            await deletion_cost.stop()
        await discovery.stop()
        await redis.aclose()


async def _ext_proc(app: web.Application) -> AsyncIterator[None]:
    metrics = PickerMetrics(app[METRICS_KEY].registry)
    async with serve_ext_proc(app[CONFIG_KEY], app[ROUTER_KEY], metrics) as port:
        app[EXT_PROC_PORT_KEY] = port
        yield


async def handle_route(request: web.Request) -> web.Response:
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(413, f"request body is too large: {exc.text}")
    try:
        route_request = RouteRequest.from_msgpack(body)
    except BadRequest as exc:
        return json_error(400, str(exc), exc.param)
    try:
        response = await request.app[ROUTER_KEY].route(route_request)
    except NoEngineError as exc:
        return json_error(exc.status, exc.message, type_="no_engine")
    return web.Response(body=response.to_msgpack(), content_type=MSGPACK)


async def handle_engines(request: web.Request) -> web.Response:
    model = request.query.get("model") or None
    rows, degraded = await request.app[ROUTER_KEY].engines(model)
    return web.json_response({"engines": [status_dict(r) for r in rows], "degraded": degraded})


async def handle_health(request: web.Request) -> web.Response:
    router = request.app[ROUTER_KEY]
    redis_ok = await router.index.ping()
    body: dict[str, Any] = {
        "status": "ok",
        "redis": "ok" if redis_ok else "unavailable",
        "discovery": {
            "kind": type(router.discovery).__name__,
            "synced": router.discovery.synced,
            "engines": len(router.discovery.current().engines),
        },
        "policy": router.policy.name.value,
    }
    return web.json_response(body)


async def handle_ready(request: web.Request) -> web.Response:
    synced = request.app[ROUTER_KEY].discovery.synced
    return web.json_response({"ready": synced}, status=200 if synced else 503)


async def handle_metrics(request: web.Request) -> web.Response:
    await request.app[DEMAND_KEY].refresh()
    payload = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})
