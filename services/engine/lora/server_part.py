"""LoRA's share of the engine server (``features.server_parts``): the ``--lora-roots`` flag, the
runtime adapter routes (``routes``), the adapter commands the engine core answers
(``commands``), vLLM's ``vllm:lora_requests_info`` gauge, the heartbeat's adapter list and the
sync with the Redis adapter registry beside the heartbeats (``registry_sync``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from services.common.cli import flag
from services.common.lora_registry import AdapterRegistry
from services.common.redis_index import connect
from services.engine.features import server_parts
from services.engine.features.server_parts import FieldSpec, ServerPart
from services.engine.lora import routes
from services.engine.lora.commands import PART, AdapterCommand, AdapterService, LoadFinished
from services.engine.lora.manager import LoRAStats
from services.engine.lora.registry_sync import RegistrySync


class LoRAServerPart(ServerPart):
    name = PART

    def server_fields(self) -> list[FieldSpec]:
        roots = flag(
            (),
            metavar="DIR",
            help="directories runtime LoRA loads may read from (comma-separated): a lora_path "
            "must resolve inside one of them, symlinks followed (default: none, runtime loads "
            "are refused)",
        )
        return [("lora_roots", tuple[str, ...], roots)]

    def add_routes(self, app: Any, core: Any, server_config: Any) -> None:
        routes.add_routes(app, core, server_config.lora_roots)

    def core_service(self, engine: Any, post: Callable[[Any], None]) -> AdapterCommands:
        return AdapterCommands(AdapterService(engine.lora, post))

    def metric_families(self, model: str, engine_index: str, stats: Any) -> Iterator[Any]:
        if stats.lora is not None:
            yield requests_info(stats.lora)

    def heartbeat_fields(self, stats: Any) -> dict[str, Any]:
        return {"adapters": routes.served_adapters(stats.lora)}

    def beside_heartbeat(self, server_config: Any, core: Any, engine_id: str) -> RegistryTask:
        registry = AdapterRegistry(connect(server_config.redis_url))
        return RegistryTask(RegistrySync(registry, core, server_config.lora_roots, engine_id))


class AdapterCommands:
    """The core loop's handle on ``AdapterService``: a command answered now, or a finished
    read (``LoadFinished``, posted by the loader thread) that answers the commands it ends."""

    def __init__(self, service: AdapterService) -> None:
        self.service = service

    def handle(self, cmd: AdapterCommand | LoadFinished) -> list[Any]:
        if isinstance(cmd, LoadFinished):
            return self.service.finish(cmd)
        reply = self.service.handle(cmd)  # None: read on the loader thread, answered later
        return [] if reply is None else [reply]

    def close(self) -> None:
        self.service.close()


class RegistryTask:
    """The registry's sync beside the heartbeats, over its own Redis connection."""

    def __init__(self, sync: RegistrySync) -> None:
        self.sync = sync

    async def tick(self, first_wait_s: float) -> None:
        await self.sync.tick(first_wait_s)

    async def close(self) -> None:
        await self.sync.close()
        await self.sync.registry.redis.aclose()


def requests_info(lora: LoRAStats) -> GaugeMetricFamily:
    """vLLM's ``vllm:lora_requests_info``: its labels say which adapters run and wait (comma
    separated) and how many fit a step; its value is when that was read, as vLLM's."""
    g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                          labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    g.add_metric([str(lora.max_loras), ",".join(lora.running), ",".join(lora.waiting)],
                 time.time())
    return g


server_parts.register(LoRAServerPart())
