"""The engine's HTTP server: the internal streaming API, /health, /metrics, Redis heartbeats.

    python -m services.engine.serving.server --port 8200 [--model PATH] [--redis-url redis://...]
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.common import internal_auth, tracing
from services.common.default_model import DEFAULT_MODEL_NAME
from services.common.http_errors import error_middleware, json_error
from services.common.logs import setup_logging
from services.engine.config import EngineConfig
from services.engine.engine import RequestUpdate
from services.engine.features import server_parts
from services.engine.serving import step_watchdog, zmq_kv_events
from services.engine.serving.core_client import CoreClient, InternalEngineError
from services.engine.serving.core_process import EngineCoreProcess
from services.engine.serving.engine_thread import EngineThread
from services.engine.serving.metrics import EngineMetrics
from services.engine.serving.server_config import ServerConfig, configs_from_args
from services.protocol import engine_api
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Lifecycle:
    """Shutdown state. SIGTERM (or SIGINT): the engine leaves the routing set first (``leaving``:
    /health turns 503, the heartbeat leaves Redis, so no router chooses it any more) while it
    still accepts the requests routed to it just before; then the listener closes and the
    requests in flight get ``shutdown_timeout`` to finish (``draining``); then it exits."""

    leaving: bool = False
    draining: bool = False
    publisher: asyncio.Task | None = None
    stopping: asyncio.Task | None = None  # the signal's leave-then-exit task
    # The caller's request id -> the engine's own (made unique), so /internal/abort can name
    # a request by the id its caller gave.
    active: dict[str, str] = field(default_factory=dict)
    # The engine core died or stalled: the server exits non-zero once it has shut down.
    core_died: bool = False
    watchdog: asyncio.Task | None = None  # step_watchdog.watch, with --step-timeout-s


_MIN_HEARTBEAT_GAP_S = 0.05
_LEAVE_TIMEOUT_S = 2.0  # leaving Redis on SIGTERM, bounded: a Redis outage must not hold it
_LATE_ARRIVALS_S = 0.5  # after leaving: requests routed just before still arrive, and are served
_CUT_AFTER_DRAIN_S = 0.5  # early heartbeats are at most 20 per second
_CORE_DEATH_EXIT_S = 5.0  # the shutdown after a core death, bounded: never a hang
_EXIT_ON_CORE_DEATH = False  # set by main(): an app embedded in tests only reports it

CORE = web.AppKey("core", CoreClient)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
METRICS = web.AppKey("metrics", EngineMetrics)
SERVER_CONFIG = web.AppKey("server_config", ServerConfig)


def create_app(engine_config: EngineConfig, server_config: ServerConfig) -> web.Application:
    """Raises ``internal_auth.MissingCredential`` without an internal credential (unless the
    config opts out): every route but /health and /metrics requires it."""
    credential = internal_auth.resolve(
        server_config.internal_token_file, server_config.insecure_no_internal_auth, "engine")
    app = web.Application(
        client_max_size=64 * 1024 * 1024,
        middlewares=[error_middleware, tracing.server_span_middleware([engine_api.GENERATE_PATH]),
                     *internal_auth.middlewares(credential)],
    )
    app[SERVER_CONFIG] = server_config
    app[LIFECYCLE] = Lifecycle()
    app.on_shutdown.append(_drain)
    app.cleanup_ctx.append(tracing.tracing_ctx(tracing.ENGINE_SERVICE))  # first: torn down last
    app.cleanup_ctx.append(_engine_ctx(engine_config))
    app.router.add_post(engine_api.GENERATE_PATH, handle_generate)
    app.router.add_post(engine_api.ABORT_PATH, handle_abort)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    for part in server_parts.parts():  # the features' own routes
        part.add_routes(app, CORE, server_config)
    return app


def _engine_ctx(engine_config: EngineConfig):
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        core = _make_core(engine_config, app[SERVER_CONFIG])
        app[CORE] = core
        name = engine_config.served_model_name or os.path.basename(
            (engine_config.model or DEFAULT_MODEL_NAME).rstrip("/")
        )
        metrics = app[METRICS] = EngineMetrics(name, lambda: core.stats,
                                               lambda: _cache_info(core))
        core.on_step = lambda tokens: metrics.requests(core.info.max_model_len).observe_step(
            tokens)
        core.on_death = lambda: _on_core_death(app)
        cfg = app[SERVER_CONFIG]
        kv_zmq = zmq_kv_events.attach(cfg.kv_events_config, core,
                                      redis_drains=bool(cfg.redis_url))
        core.start(asyncio.get_running_loop())
        lifecycle = app[LIFECYCLE]
        lifecycle.publisher = asyncio.create_task(_publish_loop(app))
        timeout = app[SERVER_CONFIG].step_timeout_s
        if timeout > 0:
            lifecycle.watchdog = asyncio.create_task(step_watchdog.watch(core, timeout))
        try:
            yield
        finally:
            logger.info("stopping the engine")
            if lifecycle.watchdog is not None:
                lifecycle.watchdog.cancel()  # the core stops now: stopping is no stall
            await _stop_publishing(app)
            await asyncio.to_thread(core.stop)
            if kv_zmq is not None:
                await asyncio.to_thread(kv_zmq.close)
            logger.info("engine stopped")

    return ctx


def _make_core(engine_config: EngineConfig, server_config: ServerConfig) -> CoreClient:
    # KV events only for a consumer (Redis, ZeroMQ): without one nobody would drain them.
    core_cls = EngineCoreProcess if server_config.engine_core == "process" else EngineThread
    return core_cls(engine_config, server_config.debug_step_delay_s,
                    publish_kv_events=bool(server_config.redis_url)
                    or zmq_kv_events.records_events(server_config.kv_events_config),
                    crash_after_steps=server_config.debug_crash_after_steps)


def _on_core_death(app: web.Application) -> None:
    """The core died (its process, or its thread inline) or stalled (``step_watchdog``): its
    requests have failed, /health turns 503 at once and, when this is the server's own
    process, it shuts down (leaving Redis) and exits 1; a hard exit bounds that."""
    app[LIFECYCLE].core_died = True
    if not _EXIT_ON_CORE_DEATH:
        return
    timer = threading.Timer(_CORE_DEATH_EXIT_S, os._exit, (1,))
    timer.daemon = True
    timer.start()
    signal.raise_signal(signal.SIGTERM)  # run_app's graceful shutdown: drain (none), cleanup


async def _stop_publishing(app: web.Application) -> None:
    """Cancels the heartbeat loop; its cleanup removes this engine from Redis at once."""
    task, app[LIFECYCLE].publisher = app[LIFECYCLE].publisher, None
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def _leave_first_on_stop_signals(app: web.Application) -> None:
    """``on_startup`` of the server's own process (``main``): SIGTERM and SIGINT start
    ``_leave_then_exit`` instead of aiohttp's immediate graceful exit, which would close the
    listener while routers still chose this engine (a gateway would meet a refused
    connection and retry elsewhere)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_stop_signal, app)


def _on_stop_signal(app: web.Application) -> None:
    lifecycle = app[LIFECYCLE]
    if lifecycle.leaving:
        return
    lifecycle.leaving = True
    lifecycle.stopping = asyncio.get_running_loop().create_task(_leave_then_exit(app))


async def _leave_then_exit(app: web.Application) -> None:
    logger.info("stop signal: leaving the routing set, then draining (shutdown_timeout=%.1fs)",
                app[SERVER_CONFIG].shutdown_timeout)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(_stop_publishing(app), _LEAVE_TIMEOUT_S)
    await asyncio.sleep(_LATE_ARRIVALS_S)
    # GracefulExit from a loop callback ends run_app as its own signal handler would: the
    # listener closes, on_shutdown (_drain) waits for the requests in flight, cleanup runs.
    asyncio.get_running_loop().call_soon(_graceful_exit)


def _graceful_exit() -> None:
    raise web.GracefulExit()


async def _drain(app: web.Application) -> None:
    """SIGTERM: stop being routable (health 503, heartbeat removed), then let the requests in
    flight finish, bounded by ``shutdown_timeout``; aiohttp then closes what remains."""
    lifecycle = app[LIFECYCLE]
    lifecycle.draining = True
    await _stop_publishing(app)
    core = app[CORE]
    deadline = time.monotonic() + app[SERVER_CONFIG].shutdown_timeout
    logger.info("draining: in_flight=%d", core.num_in_flight)
    # A request the core has finished still has its last frames to write: wait for its
    # handler too (``active``), or the shutdown would cut the stream before its end.
    while (core.num_in_flight or lifecycle.active) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    logger.info("drained: in_flight=%d streams=%d", core.num_in_flight, len(lifecycle.active))


# -- handlers ---------------------------------------------------------------------------------


async def _read_body(request: web.Request) -> bytes | web.Response:
    """The body, or the 413 to answer when it is over the app's ``client_max_size``."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        return json_error(413, f"request body is too large: {exc.text}")


async def handle_health(request: web.Request) -> web.Response:
    core = request.app[CORE]
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.leaving or lifecycle.draining:
        return web.json_response({"status": "draining"}, status=503)
    if core.load_error is not None:
        return web.json_response({"status": "error", "error": str(core.load_error)}, status=503)
    if not core.is_ready:
        return web.json_response({"status": "loading"}, status=503)
    info = core.info
    return web.json_response({
        "status": "ok",
        "model": info.model_name,
        "block_size": info.block_size,
        "max_model_len": info.max_model_len,
    })


async def handle_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def handle_abort(request: web.Request) -> web.Response:
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        rid = engine_api.AbortRequest.from_json(body).request_id
    except BadRequest as exc:
        return json_error(400, str(exc), exc.param)
    request.app[CORE].abort(request.app[LIFECYCLE].active.get(rid, rid))
    return web.json_response({"aborted": rid})


async def handle_generate(request: web.Request) -> web.StreamResponse:
    core = request.app[CORE]
    if not core.is_ready or request.app[LIFECYCLE].draining:
        return json_error(503, "engine is not ready (loading or draining)")
    body = await _read_body(request)
    if isinstance(body, web.Response):
        return body
    try:
        req = engine_api.GenerateRequest.from_msgpack(body)
        await core.checks.check(req.prompt_token_ids, req.params)
    except BadRequest as exc:  # the client's input (body, params, model limits)
        return json_error(400, str(exc), exc.param)
    except Exception as exc:  # anything else is an engine bug, never the client's 400
        logger.exception("checking a request failed")
        return _internal_error(exc)
    rid = f"{req.request_id}-{uuid.uuid4().hex[:8]}"  # unique even if a client reuses ids
    span = trace.get_current_span()  # the server span of tracing.server_span_middleware
    if span.is_recording():
        span.set_attributes({
            "pagoda.engine.id": request.app[SERVER_CONFIG].resolved_engine_id(),
            "pagoda.request_id": rid,
            "gen_ai.request.model": request.app[METRICS].model_name,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        })
    updates: asyncio.Queue = asyncio.Queue()
    active = request.app[LIFECYCLE].active
    active[req.request_id] = rid
    finished = False
    try:
        core.submit(rid, req.prompt_token_ids, req.params, req.cache_salt, updates.put_nowait,
                    req.adapter_name, req.kv_transfer_params, req.priority)
        first = await updates.get()
        if isinstance(first, BadRequest):
            finished = True
            return json_error(400, str(first), first.param)
        if isinstance(first, InternalEngineError):  # logged where it was raised
            finished = True
            return _internal_error(first)
        if isinstance(first, Exception):  # the step failed: the caller may try another engine
            finished = True
            return json_error(503, str(first))
        resp = web.StreamResponse(headers={"Content-Type": engine_api.CONTENT_TYPE})
        await resp.prepare(request)
        finished = await _stream(request.app[METRICS], resp, first, updates,
                                 core.info.max_model_len)
    except ConnectionResetError:  # the client went away mid-stream, e.g. at a stop string
        logger.debug("client closed the stream request_id=%s", rid)
    finally:
        if active.get(req.request_id) == rid:
            del active[req.request_id]
        if not finished:  # client went away, or we failed: free the KV blocks now
            core.abort(rid)
    return resp


def _cache_info(core: CoreClient) -> dict[str, str] | None:
    """vllm:cache_config_info's labels, once the engine has loaded."""
    info = core.info
    if info is None:
        return None
    return {
        "block_size": str(info.block_size),
        "cache_dtype": info.kv_cache_dtype,
        "enable_prefix_caching": str(info.enable_prefix_caching),
        "num_gpu_blocks": str(info.num_blocks),
        "prefix_caching_hash_algo": info.hash_algorithm,
    }


def _internal_error(exc: Exception) -> web.Response:
    """A 500 for an engine bug; the caller may try another engine (the gateway does)."""
    message = str(exc)
    if not message.startswith("internal engine error"):
        message = f"internal engine error: {type(exc).__name__}: {message}"
    return json_error(500, message)


async def _stream(
    metrics: EngineMetrics, resp: web.StreamResponse, first, updates: asyncio.Queue,
    max_model_len: int,
) -> bool:
    start = time.monotonic()
    last = None
    first_frame = True
    item = first
    model = metrics.model_name
    # Bound once per stream: a labels() lookup per token cost about 4 us, 3% of the serving
    # loop's own work with 256 streams of a fast model (a CPU profile).
    ttft, itl = metrics.ttft.labels(model), metrics.itl.labels(model)
    span = trace.get_current_span()
    spans = _SpanEvents(span) if span.is_recording() else None
    pending = None
    while True:
        if not isinstance(item, Exception):
            item, pending = _coalesced(item, updates)
        if isinstance(item, Exception):
            span.set_status(trace.StatusCode.ERROR, str(item))
            await resp.write(engine_api.ErrorFrame(str(item)).to_msgpack())
            return True
        if spans is not None:
            spans.on_update(item)
        now = time.monotonic()
        if item.kv_transfer_params is not None and not item.finished:  # announced: at once
            await resp.write(engine_api.KVTransferFrame(item.kv_transfer_params).to_msgpack())
        if item.new_token_ids:
            if last is None:
                ttft.observe(now - start)
            else:
                itl.observe(now - last)
            for _ in range(len(item.new_token_ids) - 1):  # coalesced: delivered together
                itl.observe(0.0)
            last = now
            cached = item.num_cached_tokens if first_frame else None
            prompt_lps = item.prompt_logprobs if first_frame else None
            first_frame = False
            lps = item.new_logprobs if any(lp is not None for lp in item.new_logprobs) else None
            await resp.write(
                engine_api.TokensFrame(item.new_token_ids, lps, cached, prompt_lps).to_msgpack()
            )
        if item.finished:
            metrics.e2e.labels(model).observe(now - start)
            metrics.observe_finished(item.num_prompt_tokens, item.num_output_tokens,
                                     item.finish_reason)
            metrics.requests(max_model_len).observe_finished(
                arrival=item.arrival_time, first_scheduled=item.first_scheduled_time,
                first_token=item.first_token_time, prompt_tokens=item.num_prompt_tokens,
                output_tokens=item.num_output_tokens, cached_tokens=item.num_cached_tokens,
                max_tokens=item.max_tokens, num_preemptions=item.num_preemptions)
            await resp.write(_finished(item))
            await resp.write_eof()
            return True
        item = pending if pending is not None else await updates.get()


def _coalesced(item: RequestUpdate, updates: asyncio.Queue) -> tuple[object, object]:
    """``item`` merged with the updates already queued behind it, so a stream that fell
    behind the engine (many streams, a fast model) catches up in one frame and one write
    instead of one per step. Returns the merged update and an error met after it (None)."""
    while not item.finished and not updates.empty():
        nxt = updates.get_nowait()
        if isinstance(nxt, Exception):
            return item, nxt
        # Merged into ``nxt`` in place: the update is this stream's alone (``replace`` built a
        # copy through the dataclass's field list, most of a merge's cost when 256 streams fall
        # behind). Its lists are new ones: a step may share one between updates.
        nxt.new_token_ids = item.new_token_ids + nxt.new_token_ids
        nxt.new_logprobs = item.new_logprobs + nxt.new_logprobs
        nxt.prompt_logprobs = item.prompt_logprobs or nxt.prompt_logprobs
        # An announcement survives a merge, except into the finished update (its own).
        if not nxt.finished and nxt.kv_transfer_params is None:
            nxt.kv_transfer_params = item.kv_transfer_params
        item = nxt
    return item, None


class _SpanEvents:
    """Turns one request's updates into events and attributes of its engine span.

    Updates come with output tokens, so ``queued`` and ``scheduled`` are added with the first
    one, at the times the engine recorded; a preemption shows as the count grows, stamped when
    it is seen (the request's next token).
    """

    __slots__ = ("first_token", "preemptions", "queued", "span")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.queued = False
        self.first_token = False
        self.preemptions = 0

    def on_update(self, u: RequestUpdate) -> None:
        span = self.span
        if not self.queued:
            self.queued = True
            span.add_event("queued", timestamp=_epoch_ns(u.arrival_time))
            if u.first_scheduled_time is not None:
                span.add_event("scheduled", {"cached_tokens": u.num_cached_tokens},
                               timestamp=_epoch_ns(u.first_scheduled_time))
                span.set_attribute("gen_ai.latency.time_in_queue",
                                   u.first_scheduled_time - u.arrival_time)
        if not self.first_token and u.first_token_time is not None:
            self.first_token = True
            span.add_event("first_token", timestamp=_epoch_ns(u.first_token_time))
            span.set_attribute("gen_ai.latency.time_to_first_token",
                               u.first_token_time - u.arrival_time)
            if u.first_scheduled_time is not None:
                span.set_attribute("gen_ai.latency.time_in_model_prefill",
                                   u.first_token_time - u.first_scheduled_time)
        if u.num_preemptions > self.preemptions:
            span.add_event("preempted", {"num_preemptions": u.num_preemptions})
            self.preemptions = u.num_preemptions
        if u.finished:
            span.add_event("finished", {"finish_reason": u.finish_reason or "",
                                        "output_tokens": u.num_output_tokens})
            span.set_attributes({
                "gen_ai.response.finish_reasons": [u.finish_reason or ""],
                "gen_ai.usage.output_tokens": u.num_output_tokens,
                "gen_ai.usage.cache_read.input_tokens": u.num_cached_tokens,
                "gen_ai.latency.e2e": time.monotonic() - u.arrival_time,
                "pagoda.engine.num_preemptions": u.num_preemptions,
            })


def _epoch_ns(monotonic_s: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _finished(u: RequestUpdate) -> bytes:
    return engine_api.FinishedFrame(u.finish_reason, u.stop_reason, u.num_prompt_tokens,
                                    u.num_output_tokens, u.num_cached_tokens,
                                    u.kv_transfer_params).to_msgpack()


# -- Redis: heartbeats and KV events ---------------------------------------------------------


async def _publish_loop(app: web.Application) -> None:
    """Publishes heartbeats and KV events while the engine runs (no-op without Redis)."""
    cfg = app[SERVER_CONFIG]
    if not cfg.redis_url:
        return
    from services.engine.serving.redis_publisher import EnginePublisher

    core = app[CORE]
    publisher = EnginePublisher(cfg, core)
    try:
        while True:
            core.load_changed.clear()
            await publisher.publish_once()
            # Every interval, or sooner when a request arrives or finishes: the routers' view
            # of this engine's load (and their count of requests routed since this heartbeat)
            # is then at most _MIN_HEARTBEAT_GAP_S old under load, not a whole interval.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(core.load_changed.wait(), cfg.heartbeat_interval_s)
                await asyncio.sleep(_MIN_HEARTBEAT_GAP_S)
    finally:
        await publisher.close()


# -- CLI --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    engine_config, server_config = configs_from_args(argv)  # flags: server_config.py
    try:  # once, for every part of the engine: the routes, the KV transfer port, node joins
        internal_auth.export(internal_auth.resolve(
            server_config.internal_token_file, server_config.insecure_no_internal_auth,
            "engine"), os.environ)
    except ValueError as exc:  # MissingCredential, or a malformed token (its position only)
        setup_logging(server_config.log_level, "engine")
        logger.error("%s", exc)
        raise SystemExit(2) from None
    if engine_config.node_rank != 0:  # a worker node: no API, no router (node_worker.py)
        _run_worker_node(engine_config, server_config)
        return
    setup_logging(server_config.log_level, "engine")
    global _EXIT_ON_CORE_DEATH
    _EXIT_ON_CORE_DEATH = True
    try:
        app = create_app(engine_config, server_config)
    except internal_auth.MissingCredential as exc:
        logger.error("%s", exc)
        raise SystemExit(2) from None
    app.on_startup.append(_leave_first_on_stop_signals)
    # handler_cancellation: a client that goes away cancels its handler at once (even during
    # prefill), and the handler's finally-block aborts the request and frees its KV blocks.
    # The grace period is spent in _drain (on_shutdown); whatever still runs after it is cut
    # at once, so SIGTERM-to-exit stays within shutdown_timeout plus about a second and a half
    # (leaving Redis and taking the late arrivals first: _leave_then_exit).
    web.run_app(app, host=server_config.host, port=server_config.port, print=None,
                shutdown_timeout=_CUT_AFTER_DRAIN_S, handler_cancellation=True)
    if app[LIFECYCLE].core_died:
        logger.error("exiting: the engine core died or stalled")
        raise SystemExit(1)


def _run_worker_node(engine_config: EngineConfig, server_config: ServerConfig) -> None:
    from services.engine.models.default import default_model_path
    from services.engine.serving import node_worker

    setup_logging(server_config.log_level, f"engine-node{engine_config.node_rank}")
    node_worker.run(engine_config, server_config,
                    engine_config.model or str(default_model_path()))


if __name__ == "__main__":
    main()
