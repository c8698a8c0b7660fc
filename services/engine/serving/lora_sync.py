"""An engine's side of the adapter registry in Redis (``services.common.lora_registry``): keeps
its runtime adapters equal to what is registered for its model.

Run by the Redis publisher before each heartbeat: one GET of the registry's counter; when it
moved (and once at start, before the engine's first heartbeat, so an engine is routable only
with the adapters its peers have), the registry is read and compared with the engine's runtime
adapters (``--lora-modules`` and offline ones are not the registry's to remove): what is
missing is loaded, what is gone is unloaded, through the same commands as the load API. A load
that fails is logged and not retried until its registry entry changes.
"""

from __future__ import annotations

import logging

from services.common.lora_registry import AdapterRegistry
from services.engine.lora.commands import LOAD, UNLOAD, AdapterCommand
from services.engine.lora.manager import RUNTIME
from services.engine.serving.core_client import CoreClient

logger = logging.getLogger(__name__)


class RegistrySync:
    def __init__(self, registry: AdapterRegistry, core: CoreClient, roots: tuple[str, ...]
                 ) -> None:
        self.registry = registry
        self.core = core
        self.roots = roots
        self._generation: int | None = None
        self._failed: dict[str, str] = {}  # name -> the path that failed to load

    async def sync_once(self) -> None:
        core = self.core
        if not core.is_ready or core.stats is None or core.stats.lora is None:
            return  # not loaded yet, or an engine without LoRA
        model = core.info.model_name
        generation = await self.registry.generation(model)
        if generation == self._generation:
            return
        want = await self.registry.entries(model)
        have = {a.name: a.path for a in core.stats.lora.adapters if a.origin == RUNTIME}
        for name, path in want.items():
            if have.get(name) != path and self._failed.get(name) != path:
                await self._load(name, path, replace=name in have)
        for name in have.keys() - want.keys():
            await core.adapter(AdapterCommand(UNLOAD, name))
            logger.info("adapter %s unloaded: no longer registered", name)
        self._generation = generation

    async def _load(self, name: str, path: str, replace: bool) -> None:
        if replace:
            await self.core.adapter(AdapterCommand(UNLOAD, name))
        reply = await self.core.adapter(AdapterCommand(LOAD, name, path, self.roots))
        if reply.status == 200:
            self._failed.pop(name, None)
            logger.info("adapter %s loaded from the registry", name)
        else:
            self._failed[name] = path
            logger.warning("registered adapter %s (%s) failed to load: %s", name, path,
                           reply.message)
