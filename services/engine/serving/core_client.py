"""The event loop's handle on the engine core, wherever the core runs (thread or process).

It keeps what the server reads between steps (the engine's ``info`` and ``checks`` once it
has loaded, stats, KV events, step time, requests in flight) and routes each ``CoreOutputs``
batch to the per-request sinks. Everything here is read and written on the event loop only:
the core hands over what it learns (``_ready``, ``_dispatch``) by message, never by sharing
the engine.

A core that dies (its thread or process) or stalls (``stalled_for``: requests wait and no
batch comes, see ``step_watchdog``) is failed once (``fail``): every request in flight gets
its error at once, ``load_error`` turns /health 503, and ``on_death`` tells the server, which
leaves the routing set and exits. A core is never revived: the pod restarts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from services.engine.engine import EngineStats, RequestUpdate
from services.engine.features.server_parts import PartCommand
from services.engine.serving.core_loop import (
    BAD_REQUEST,
    INTERNAL,
    Abort,
    Add,
    Command,
    CoreError,
    CoreOutputs,
    Resync,
)
from services.engine.serving.engine_info import EngineInfo, RequestChecks
from services.engine.serving.kv_event_queue import MAX_QUEUED_KV_EVENTS, KVEventQueue
from services.protocol.kv_events import KVEvent
from services.protocol.sampling_params import SamplingParams
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)

Sink = Callable[[RequestUpdate | Exception], None]


class InternalEngineError(RuntimeError):
    """A request failed on an engine bug, not on its input: a 500, never a 400."""


def error_for(err: CoreError) -> Exception:
    """The exception a request's sink receives for a ``CoreError``."""
    if err.kind == BAD_REQUEST:
        return BadRequest(err.message, err.param)
    if err.kind == INTERNAL:
        return InternalEngineError(err.message)
    return RuntimeError(err.message)


class CoreClient:
    """Submit, abort and the latest snapshots; subclasses deliver commands to the core and
    call ``_dispatch`` on the event loop with each batch it sends back."""

    def __init__(
        self, publish_kv_events: bool = False, max_kv_events: int = MAX_QUEUED_KV_EVENTS
    ) -> None:
        """``publish_kv_events``: the core records its KV events and they queue on
        ``kv_events`` for a consumer that drains them (the Redis publisher); off (no
        consumer), the block manager records none."""
        self.info: EngineInfo | None = None  # set once the engine has loaded
        self.checks: RequestChecks | None = None
        self.load_error: BaseException | None = None
        self.stats: EngineStats | None = None
        self.publish_kv_events = publish_kv_events
        self.kv_events = KVEventQueue(self.request_kv_resync, max_kv_events)
        # Where each step's KV events go: the Redis publisher's queue, and any other consumer
        # (the ZeroMQ publisher); the server removes the queue when no Redis drains it.
        self.kv_event_sinks: list[Callable[[list[KVEvent]], None]] = [self.kv_events.extend]
        # Median wall time (ms) of the recent steps, published in heartbeats: how slow this
        # engine is compared with its peers, whatever its load.
        self.step_ms = 0.0
        # Set when a request arrives or finishes: the Redis publisher then sends a heartbeat
        # early, so routers see the load change within milliseconds.
        self.load_changed = asyncio.Event()
        # Called on the event loop after each step with the tokens it computed.
        self.on_step: Callable[[int], None] | None = None
        self._sinks: dict[str, Sink] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}  # the parts' commands
        self._reply_ids = itertools.count(1)
        # Called on the event loop when the core died or stalled unasked (``fail``).
        self.on_death: Callable[[], None] | None = None
        self.died = False
        # When the core last showed progress (a batch came), or requests began to wait on it.
        self._progress_at = time.monotonic()

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.load_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    @property
    def num_accepted(self) -> int:
        """Requests submitted and not yet finished: unlike ``stats`` (updated after each
        step) it includes requests that arrived since the last step."""
        return len(self._sinks)

    # -- called from the event loop -------------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        sink: Sink,
        adapter_name: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        priority: int = 0,
    ) -> None:
        assert request_id not in self._sinks, request_id  # the server makes ids unique
        if not self._sinks:  # an idle core owes no progress: the clock starts now
            self._progress_at = time.monotonic()
        self._sinks[request_id] = sink
        self._send(Add(request_id, prompt_token_ids, params, cache_salt, adapter_name,
                       kv_transfer_params, priority))
        self.load_changed.set()

    async def command(self, cmd: PartCommand) -> Any:
        """A feature's command to its service in the core (``features.server_parts``: loading
        an adapter); its answer comes with a step's outputs."""
        if self.died:  # nobody would answer
            raise RuntimeError("the engine core is gone")
        cmd.reply_to = next(self._reply_ids)
        future = asyncio.get_running_loop().create_future()
        self._replies[cmd.reply_to] = future
        self._send(cmd)
        try:
            return await future
        finally:
            self._replies.pop(cmd.reply_to, None)

    def abort(self, request_id: str) -> None:
        if request_id in self._sinks:
            self._send(Abort(request_id))

    def request_kv_resync(self) -> None:
        """Asks the core to queue its whole prefix cache on ``kv_events`` ("cleared", then
        every cached hash), after the events already queued: for an index that lost this
        engine's entries."""
        self._send(Resync())

    def _send(self, cmd: Command) -> None:
        raise NotImplementedError

    def _ready(self, info: EngineInfo, checks: RequestChecks) -> None:
        self.info, self.checks = info, checks
        logger.info("engine ready: model=%s max_model_len=%d kv_blocks=%d", info.model_name,
                    info.max_model_len, info.num_blocks)

    def stalled_for(self, now: float) -> float:
        """Seconds requests have waited on the core without a batch from it (0 while none
        waits). A core that steps sends a batch every step."""
        return now - self._progress_at if self._sinks else 0.0

    def fail(self, message: str) -> None:
        """The core is dead or stuck (see the module docstring); once."""
        if self.died:
            return
        self.died = True
        if self.load_error is None:
            self.load_error = RuntimeError(message)
        self._fail_all(message)
        if self.on_death is not None:
            self.on_death()

    def _dispatch(self, out: CoreOutputs) -> None:
        self._progress_at = time.monotonic()
        sinks = self._sinks
        done = bool(out.errors)
        for err in out.errors:
            sink = sinks.pop(err.request_id, None)
            if sink is not None:
                sink(error_for(err))
        for update in out.updates:
            if update.finished:
                done = True
                sink = sinks.pop(update.request_id, None)
            else:
                sink = sinks.get(update.request_id)
            if sink is not None:
                sink(update)
        if out.stats is not None:
            self.stats = out.stats
        for reply in out.replies:
            future = self._replies.get(reply.reply_to)
            if future is not None and not future.done():
                future.set_result(reply)
        if out.kv_events:
            for sink in self.kv_event_sinks:
                sink(out.kv_events)
        self.step_ms = out.step_ms
        if out.step_tokens is not None and self.on_step is not None:
            self.on_step(out.step_tokens)
        if done:
            self.load_changed.set()

    def _fail_all(self, message: str) -> None:
        """The core is gone: every request in flight ends with an error now."""
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink(RuntimeError(message))
        for future in self._replies.values():
            if not future.done():
                future.set_exception(RuntimeError(message))
        self.load_changed.set()
