"""An engine's side of the adapter registry in Redis (``services.common.lora_registry``): keeps
its runtime adapters equal to what is registered for its model.

Runs beside the heartbeat, never inside it: the Redis publisher calls ``tick`` before each
heartbeat, which starts a sync task when none runs and returns. Only before the engine's first
heartbeat does it wait for the first sync (at most ``first_wait_s``), so an engine is routable
with the adapters its peers have unless they take longer than that; a slow load never delays a
heartbeat past its TTL. A sync: one GET of the registry's counter; when it moved (and once at
start), the registry is read and compared with the engine's runtime adapters
(``--lora-modules`` and offline ones are not the registry's to remove): what is missing is
loaded, what is gone is unloaded, through the same commands as the load API, each with a
timeout. A load the engine refuses (400) or fails on (500) is quarantined in the registry with
its answer, so no engine of the model tries it again until it is registered anew; one that timed
out, or any other answer, is retried at the next sync. Failures are logged at WARNING.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from services.common.lora_registry import AdapterRegistry, Quarantined
from services.engine.lora.commands import (
    LOAD,
    UNLOAD,
    AdapterCommand,
    AdapterCore,
    AdapterReply,
)
from services.engine.lora.files import READ_DEADLINE_S
from services.engine.lora.manager import RUNTIME

logger = logging.getLogger(__name__)

# One command's answer: a load queued behind others on the loader thread may take a few reads.
COMMAND_TIMEOUT_S = 2 * READ_DEADLINE_S
_QUARANTINED = (400, 500)  # the adapter's fault, or it breaks the engine: not tried again


class RegistrySync:
    def __init__(self, registry: AdapterRegistry, core: AdapterCore, roots: tuple[str, ...],
                 engine_id: str = "", command_timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.registry = registry
        self.core = core
        self.roots = roots
        self.engine_id = engine_id
        self.command_timeout_s = command_timeout_s
        self._generation: int | None = None
        self._task: asyncio.Task | None = None
        self._waited = False

    async def tick(self, first_wait_s: float) -> None:
        """Starts a sync when none runs; the first time the engine is ready, waits for it at
        most ``first_wait_s`` (once: later heartbeats never wait)."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._sync_logged())
        if not self._waited and self.core.is_ready:
            self._waited = True
            await asyncio.wait({self._task}, timeout=first_wait_s)

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _sync_logged(self) -> None:
        try:
            await self.sync_once()
        except Exception as exc:  # noqa: BLE001 -- Redis down, a core gone: the next tick retries
            logger.warning("adapter registry sync failed: %s: %s", type(exc).__name__, exc)

    async def sync_once(self) -> None:
        core = self.core
        if not core.is_ready or core.stats is None or core.stats.lora is None:
            return  # not loaded yet, or an engine without LoRA
        model = core.info.model_name
        generation = await self.registry.generation(model)
        if generation == self._generation:
            return
        want = await self.registry.entries(model)
        bad = await self.registry.quarantined(model)
        have = {a.name: a.path for a in core.stats.lora.adapters if a.origin == RUNTIME}
        done = True
        for name, path in want.items():
            if have.get(name) != path and (name not in bad or bad[name].path != path):
                done &= await self._load(model, name, path, replace=name in have)
        for name in have.keys() - want.keys():
            done &= await self._command(AdapterCommand(UNLOAD, name)) is not None
            logger.info("adapter %s unloaded: no longer registered", name)
        if done:  # else the next tick tries what timed out again
            self._generation = generation

    async def _load(self, model: str, name: str, path: str, replace: bool) -> bool:
        """False when an answer did not come in time."""
        if replace and await self._command(AdapterCommand(UNLOAD, name)) is None:
            return False
        reply = await self._command(AdapterCommand(LOAD, name, path, self.roots))
        if reply is None:
            return False
        if reply.status == 200:
            logger.info("adapter %s loaded from the registry", name)
        elif reply.status in _QUARANTINED:
            logger.warning("registered adapter %s (%s) failed to load (%d), quarantined: %s",
                           name, path, reply.status, reply.message)
            await self.registry.quarantine(model, name, Quarantined(
                path, f"{reply.status}: {reply.message}", self.engine_id))
        else:
            logger.warning("registered adapter %s (%s) failed to load (%d): %s", name, path,
                           reply.status, reply.message)
        return True

    async def _command(self, cmd: AdapterCommand) -> AdapterReply | None:
        try:
            return await asyncio.wait_for(self.core.command(cmd), self.command_timeout_s)
        except TimeoutError:
            logger.warning("adapter %s: no answer to %s within %.0f s; tried again later",
                           cmd.name, cmd.op, self.command_timeout_s)
            return None
