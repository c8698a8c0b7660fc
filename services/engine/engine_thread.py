"""Runs an ``LLMEngine`` in its own thread so the model step never blocks the event loop.

The asyncio side submits and aborts through a thread-safe queue; each step's updates are
handed back to the loop with ``call_soon_threadsafe``. One thread owns the engine, so the
engine itself needs no locks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.config import EngineConfig
from services.engine.engine import EngineStats, LLMEngine, RequestUpdate
from services.protocol.engine_api import BadRequest
from services.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Sink = Callable[[RequestUpdate | Exception], None]
_IDLE_WAIT_S = 0.05
_STEP_WINDOW = 32  # recent steps whose median is ``step_ms``


class InternalEngineError(RuntimeError):
    """A request failed on an engine bug, not on its input: a 500, never a 400."""


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    sink: Sink


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Resync:
    """Re-announce the whole prefix cache through ``kv_events``."""


class EngineThread:
    """The engine's own thread and the event loop's handle on it (submit, abort, stats)."""

    def __init__(self, config: EngineConfig, step_delay_s: float = 0.0) -> None:
        if not step_delay_s >= 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s!r}")
        self.config = config
        # Fault injection (tests, drills): a sleep before every step makes a slow engine.
        self.step_delay_s = step_delay_s
        self.engine: LLMEngine | None = None
        self.load_error: BaseException | None = None
        self.stats: EngineStats | None = None
        self.kv_events: deque = deque(maxlen=1_000_000)  # drained by the Redis publisher
        self.loaded = threading.Event()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set (on the event loop) when a request arrives or finishes: the Redis publisher then
        # sends a heartbeat early, so routers see the load change within milliseconds.
        self.load_changed = asyncio.Event()
        # Requests submitted and not yet finished, counted on the event loop: unlike ``stats``
        # (updated after each step) it includes requests that arrived since the last step.
        self.num_accepted = 0
        # Median wall time (ms) of the recent steps, published in heartbeats: how slow this
        # engine is compared with its peers, whatever its load. A median, so one stalled step
        # (a pause, a long prefill) does not brand the engine slow.
        self.step_ms = 0.0
        self._step_times: deque[float] = deque(maxlen=_STEP_WINDOW)
        # Called on the engine thread after each step, with the engine (metrics read its step).
        self.on_step: Callable[[LLMEngine], None] | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_ready(self) -> bool:
        return self.loaded.is_set() and self.engine is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    # -- called from the event loop -----------------------------------------------------------

    def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        sink: Sink,
    ) -> None:
        self.num_accepted += 1

        def deliver(item: RequestUpdate | Exception) -> None:
            if isinstance(item, Exception) or item.finished:
                self.num_accepted -= 1
            sink(item)

        self._commands.put(_Add(request_id, prompt_token_ids, params, cache_salt, deliver))
        self.load_changed.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def request_kv_resync(self) -> None:
        """Asks the engine thread to queue its whole prefix cache on ``kv_events`` ("cleared",
        then every cached hash), after the events already queued: for an index that lost
        this engine's entries."""
        self._commands.put(_Resync())

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config)
            self.stats = self.engine.stats()
        except BaseException as exc:  # reported by /health; the process stays up to say so
            logger.exception("engine failed to load")
            self.load_error = exc
            return
        finally:
            self.loaded.set()
        logger.info("engine ready: model=%s", self.engine.model_name)
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not self.engine.has_unfinished_requests())
                if self.engine.has_unfinished_requests():
                    self._step()
        finally:
            # Before this thread ends: tensor-parallel workers die with the thread that
            # started them, and an unannounced death reads as a failure.
            self.engine.close()

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: _Add | _Abort | _Resync) -> None:
        engine = self.engine
        if isinstance(cmd, _Resync):
            self.kv_events.extend(engine.take_kv_events())
            self.kv_events.extend(engine.block_manager.snapshot_events())
            return
        if isinstance(cmd, _Abort):
            if cmd.request_id in self._sinks:
                update = engine.abort_request(cmd.request_id)
                self._deliver(cmd.request_id, update)
            return
        try:
            engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.cache_salt)
        except BadRequest as exc:  # the client's input: a 400 naming the field
            self._post(cmd.sink, exc)
            return
        except Exception as exc:  # a bug must fail this request, never the engine thread
            logger.exception("add_request failed request_id=%s", cmd.request_id)
            error = InternalEngineError(f"internal engine error adding the request: {exc}")
            self._post(cmd.sink, error)
            return
        self._sinks[cmd.request_id] = cmd.sink

    def _step(self) -> None:
        start = time.perf_counter()
        if self.step_delay_s:
            self._stop.wait(self.step_delay_s)
        try:
            updates = self.engine.step()
        except Exception as exc:  # a model failure must not kill the loop silently
            logger.exception("engine step failed; aborting in-flight requests")
            for rid in list(self._sinks):
                self.engine.abort_request(rid)
                self._post(self._sinks.pop(rid), RuntimeError(f"engine step failed: {exc}"))
            return
        if self.on_step is not None:
            self.on_step(self.engine)
        self._step_times.append((time.perf_counter() - start) * 1000)
        self.step_ms = statistics.median(self._step_times)
        for update in updates:
            self._deliver(update.request_id, update)
        self.stats = self.engine.stats()
        self.kv_events.extend(self.engine.take_kv_events())

    def _deliver(self, request_id: str, update: RequestUpdate | None) -> None:
        if update is None:
            return
        sink = self._sinks.pop(request_id) if update.finished else self._sinks.get(request_id)
        if sink is not None:
            self._post(sink, update)
        if update.finished:
            self.stats = self.engine.stats()
            self.kv_events.extend(self.engine.take_kv_events())
            self._loop.call_soon_threadsafe(self.load_changed.set)

    def _post(self, sink: Sink, item: RequestUpdate | Exception) -> None:
        self._loop.call_soon_threadsafe(sink, item)
