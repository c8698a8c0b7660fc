"""Which engines the gateway is waiting on, and cutting those waits when an engine hangs.

A crashed engine resets its connections, so its requests fail at once. A hung one (frozen
process, stalled node, network partition) does not: its TCP connections stay open and a
request waiting for its first token would wait out the whole request timeout. The engines
poller notices when an engine leaves the live set (its heartbeat expired) and asks
``check_gone``; an engine whose ``/health`` probe times out (``probe_timeout_s``) is declared
dead and every wait on it ends now:

- opening a stream (no token yet) raises TimeoutError in ``guard()``: the request is retried on
  another engine, as for a refused connection;
- a stream in progress is closed: it ends with an error event.

An engine that left the set but answers, or refuses the connection (a graceful drain closes
its listener first, then lets its requests finish), is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

import aiohttp

logger = logging.getLogger(__name__)

DEFAULT_PROBE_TIMEOUT_S = 2.0


class Closable(Protocol):
    def close(self) -> None: ...


class EngineWatch:
    def __init__(self, session: aiohttp.ClientSession,
                 probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        self._session = session
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._opening: dict[str, set[asyncio.Timeout]] = {}
        self._streams: dict[str, set[Closable]] = {}
        self._urls: dict[str, str] = {}
        self._probing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- registration (generation side) --------------------------------------------------------

    @contextlib.asynccontextmanager
    async def guard(self, engine_id: str, url: str) -> AsyncIterator[None]:
        """Wraps opening a stream on ``engine_id``: raises TimeoutError out of the block if
        the engine is declared dead meanwhile."""
        self._urls[engine_id] = url
        async with asyncio.timeout(None) as deadline:
            waits = self._opening.setdefault(engine_id, set())
            waits.add(deadline)
            try:
                yield
            finally:
                waits.discard(deadline)
                if not waits:
                    self._opening.pop(engine_id, None)

    def add_stream(self, engine_id: str, stream: Closable) -> None:
        """Registers a stream opened inside ``guard()`` (which recorded the engine's URL)."""
        self._streams.setdefault(engine_id, set()).add(stream)

    def remove_stream(self, engine_id: str, stream: Closable) -> None:
        streams = self._streams.get(engine_id)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                self._streams.pop(engine_id, None)

    def waiting_on(self, engine_id: str) -> int:
        return len(self._opening.get(engine_id, ())) + len(self._streams.get(engine_id, ()))

    # -- detection (poller side) ---------------------------------------------------------------

    def check_gone(self, live_engine_ids: Iterable[str]) -> None:
        """Probes, in the background, every engine this gateway waits on that is not in
        ``live_engine_ids``."""
        live = set(live_engine_ids)
        for engine_id in set(self._opening) | set(self._streams):
            if engine_id not in live and engine_id not in self._probing:
                self._probing.add(engine_id)
                task = asyncio.create_task(self._probe(engine_id))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _probe(self, engine_id: str) -> None:
        try:
            url = self._urls.get(engine_id)
            if url is None or await self._answers(url):
                return
            self.declare_dead(engine_id)
        finally:
            self._probing.discard(engine_id)

    async def _answers(self, url: str) -> bool:
        """False only when the probe times out: the engine (or its host, or the path to it)
        hangs. Any HTTP answer means alive. A refused or reset connection means the process
        is draining (its listener is closed, its requests still finish) or gone (then the
        kernel reset our connections to it, and those requests have failed over already)."""
        try:
            async with self._session.get(url.rstrip("/") + "/health",
                                         timeout=self._probe_timeout) as resp:
                await resp.read()
                return True
        except TimeoutError:
            return False
        except (aiohttp.ClientError, OSError):
            return True

    def declare_dead(self, engine_id: str) -> None:
        """Ends every wait on ``engine_id`` now (see the module doc)."""
        opening = self._opening.pop(engine_id, set())
        streams = self._streams.pop(engine_id, set())
        if not opening and not streams:
            return
        logger.warning("engine %s stopped answering; failing over %d waiting and %d streaming "
                       "requests", engine_id, len(opening), len(streams))
        loop = asyncio.get_running_loop()
        for deadline in opening:
            deadline.reschedule(loop.time())
        for stream in streams:
            stream.close()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
