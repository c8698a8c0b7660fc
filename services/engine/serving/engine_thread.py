"""``--engine-core inline``: the engine core's loop in a thread of the server process.

The model step never blocks the event loop, but both share one GIL: the core's Python work
per step and the loop's per-token work slow each other down (``--engine-core process`` runs
the core in its own process instead). Commands go through the loop's thread-safe queue; each
step's batch comes back with one ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from services.engine.config import EngineConfig
from services.engine.serving.core_client import CoreClient, InternalEngineError
from services.engine.serving.core_loop import Command, CoreLoop, CoreOutputs

logger = logging.getLogger(__name__)

__all__ = ["EngineThread", "InternalEngineError"]


class EngineThread(CoreClient):
    """The engine's own thread and the event loop's handle on it (submit, abort, stats)."""

    def __init__(self, config: EngineConfig, step_delay_s: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.core = CoreLoop(config, self._emit, step_delay_s)
        self.loaded = threading.Event()
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
        self._loop.call_soon_threadsafe(self._dispatch, out)

    def _run(self) -> None:
        try:
            engine = self.core.load()
            self.stats = engine.stats()
        except BaseException as exc:  # reported by /health; the process stays up to say so
            logger.exception("engine failed to load")
            self.load_error = exc
            return
        finally:
            self.loaded.set()
        self.engine = engine
        logger.info("engine ready: model=%s", engine.model_name)
        self.core.run()
