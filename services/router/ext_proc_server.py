"""The endpoint picker's gRPC server, beside the router's HTTP app (one event loop, one
``Router``): Envoy's ext_proc on ``--ext-proc-port`` with the gRPC health service.

Health, as the endpoint-picker protocol names its services: ``liveness`` is SERVING while the
process answers; ``readiness``, ``""`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` are
SERVING only while the router's state is synced: discovery synced, Redis answering, and at
least one engine registered. They are re-checked every ``HEALTH_INTERVAL_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from services.common.flow_control import (
    EngineLoad,
    FlowController,
    FlowMetrics,
    LoadSource,
)
from services.router.config import RouterConfig, tokenizer_dirs
from services.router.ext_proc import ExtProcService, Picker, PickerLimits, PickerMetrics
from services.router.model_facts import ModelCatalog
from services.router.pick_prompt import PromptReader, load_tokenizers
from services.router.routing import Router

logger = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
HEALTH_INTERVAL_S = 1.0
_GRACE_S = 5.0


def limits_of(config: RouterConfig) -> PickerLimits:
    return PickerLimits(
        max_body_bytes=config.ext_proc_max_body_bytes,
        body_timeout_s=config.ext_proc_body_timeout_s,
        stream_timeout_s=config.ext_proc_stream_timeout_s,
        endpoints=config.ext_proc_endpoints,
        shed_waiting=config.ext_proc_shed_waiting,
        max_buffered_bytes=config.ext_proc_max_buffered_bytes,
    )


def engine_loads(router: Router) -> LoadSource:
    """Flow control's view of a model's engines: their heartbeats and the router's pending,
    for the engines discovery admits."""

    async def loads(model: str) -> list[EngineLoad]:
        rows, _ = await router.engines(model)
        return [EngineLoad(r.waiting, r.pending, r.kv_usage) for r in rows if r.discovered]

    return loads


async def router_synced(router: Router) -> bool:
    if not router.discovery.synced or not await router.index.ping():
        return False
    return bool(await router.index.models())


async def _watch_health(router: Router, health: health_aio.HealthServicer) -> None:
    serving = None
    while True:
        now = await router_synced(router)
        if now != serving:
            serving = now
            status = health_pb2.HealthCheckResponse.SERVING if now else \
                health_pb2.HealthCheckResponse.NOT_SERVING
            for name in READY_SERVICES:
                await health.set(name, status)
            logger.info("picker readiness serving=%s", now)
        await asyncio.sleep(HEALTH_INTERVAL_S)


@contextlib.asynccontextmanager
async def serve_ext_proc(config: RouterConfig, router: Router,
                         metrics: PickerMetrics) -> AsyncIterator[int]:
    """Runs the picker while the context is open; yields the bound port."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="picker-tokenize")
    loop = asyncio.get_running_loop()
    tokenizers = await loop.run_in_executor(
        pool, load_tokenizers, tokenizer_dirs(config.tokenizer))
    prompts = PromptReader(ModelCatalog(router.index), tokenizers, pool,
                           tenant_from_key=config.ext_proc_tenant_from_key)
    limits = limits_of(config)
    max_message = limits.max_body_bytes + (1 << 20)  # one buffered body, headers, metadata
    server = grpc.aio.server(
        maximum_concurrent_rpcs=config.ext_proc_max_streams,
        options=[("grpc.max_receive_message_length", max_message),
                 ("grpc.max_send_message_length", max_message)],
    )
    flow = FlowController(config.flow_config(), engine_loads(router),
                          FlowMetrics(metrics.registry, "pagoda_router"))
    pb_grpc.add_ExternalProcessorServicer_to_server(
        ExtProcService(Picker(router, prompts, limits, flow, config.ext_proc_target_port),
                       metrics), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    await health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    for name in READY_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    port = server.add_insecure_port(f"{_grpc_host(config.host)}:{config.ext_proc_port}")
    await server.start()
    watcher = asyncio.create_task(_watch_health(router, health))
    logger.info("endpoint picker (ext_proc) on port %d tokenizers=%s", port, sorted(tokenizers))
    try:
        yield port
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await health.enter_graceful_shutdown()
        await server.stop(_GRACE_S)
        pool.shutdown(wait=False, cancel_futures=True)


def _grpc_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


EXT_PROC_PORT_KEY = web.AppKey("ext_proc_port", int)  # the bound port, once serving
