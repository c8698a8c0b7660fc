"""``--engine-core inline``: the engine core's loop in a thread of the server process.

The model step never blocks the event loop, but both share one GIL: the core's Python work
per step and the loop's per-token work slow each other down (``--engine-core process`` runs
the core in its own process instead). Commands go through the loop's thread-safe queue; the
engine's description once loaded, and each step's batch, come back with one
``call_soon_threadsafe`` each: the event loop never reads the engine.

An exception that escapes the core's loop ends the thread; it tells the event loop first
(``CoreClient.fail``): the requests in flight fail at once and /health turns 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable

from services.engine.config import EngineConfig
from services.engine.serving.core_client import CoreClient
from services.engine.serving.core_loop import Command, CoreLoop, CoreOutputs
from services.engine.serving.engine_info import EngineInfo, RequestChecks
from services.engine.serving.kv_event_queue import MAX_QUEUED_KV_EVENTS

logger = logging.getLogger(__name__)


class EngineThread(CoreClient):
    """The engine's own thread and the event loop's handle on it (submit, abort, stats)."""

    def __init__(
        self, config: EngineConfig, step_delay_s: float = 0.0, publish_kv_events: bool = False,
        max_kv_events: int = MAX_QUEUED_KV_EVENTS, crash_after_steps: int = 0,
    ) -> None:
        super().__init__(publish_kv_events, max_kv_events)
        self.config = config
        self.core = CoreLoop(config, self._emit, step_delay_s, kv_events=publish_kv_events,
                             crash_after_steps=crash_after_steps)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.core.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, cmd: Command) -> None:
        self.core.commands.put(cmd)

    def _emit(self, out: CoreOutputs) -> None:
        self._to_loop(self._dispatch, out)

    def _to_loop(self, fn: Callable[..., None], *args: object) -> None:
        # A server stopped while the engine loaded has closed its loop: nobody is listening.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            engine = self.core.load()
            info = EngineInfo.of(engine)
        except BaseException as exc:  # reported by /health; the process stays up to say so
            logger.exception("engine failed to load")
            self._to_loop(setattr, self, "load_error", exc)
            return
        # The engine's own compiler (thread-safe): a grammar the server compiled is a cache
        # hit when the request is added, never a second compile.
        checks = RequestChecks(info, engine.grammars)
        self._to_loop(self._ready, info, checks)
        try:
            self.core.run()  # returns at once if the server stopped meanwhile
        except BaseException as exc:  # the thread ends here: never silently
            logger.exception("engine core thread died")
            self._to_loop(self.fail, f"engine core thread died ({type(exc).__name__})")
