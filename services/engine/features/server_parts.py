"""What a feature adds to the engine server, found as its step feature is (``registry``): a
part that serves something of its own holds a module named ``server_part`` (``PART_MODULE``),
which registers a ``ServerPart`` here; the serving layer asks for every registered part
(``parts``) at its fixed points and names none of them:

    server_fields       the server's own flags the part reads (``ServerConfig`` fields, each a
                        ``cli.flag``), placed before the internal API's auth flags
    add_routes          the HTTP routes it answers (the app's core client under ``core``)
    core_service        in the engine core, the service that answers the part's commands
                        (a ``PartCommand`` names its part; the core loop routes it there)
    metric_families     Prometheus families read from the engine's stats at scrape time
    heartbeat_fields    ``EngineHeartbeat`` fields it fills from the engine's stats
    beside_heartbeat    a task the Redis publisher ticks before each heartbeat and closes

Every hook has a no-op default. The parts are imported with the server's config (its flags
are theirs too), in the server process and in the engine core's. The serving layer imports
this module, the parts import it too, and neither imports the other (a part cannot import
``serving``: that imports the core, which imports the part for vLLM's public API).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from services.engine.features.registry import providers

# The module of an engine part that registers its server part (see the module docstring).
PART_MODULE = "server_part"

# (name, type, field) of a ``ServerConfig`` field, as ``dataclasses.make_dataclass`` takes it.
FieldSpec = tuple[str, Any, dataclasses.Field]


class PartCommand(Protocol):
    """A command the server sends a part's core service: ``part`` routes it, and the answer
    carries ``reply_to`` back to the caller (``CoreClient.command``)."""

    part: str
    reply_to: int


class CoreService(Protocol):
    """A part's side of the engine core, on its loop's thread (it owns the engine)."""

    def handle(self, cmd: Any) -> list[Any]:
        """The answers (each with its ``reply_to``) the command has now: none when it
        finishes later, as another command the service posted itself."""
        ...

    def close(self) -> None: ...


class BesideHeartbeat(Protocol):
    """Work the Redis publisher runs beside its heartbeats (``tick`` before each one)."""

    async def tick(self, first_wait_s: float) -> None: ...

    async def close(self) -> None: ...


class ServerPart:
    """One feature's share of the engine server (see the module docstring)."""

    name: str = ""

    def server_fields(self) -> list[FieldSpec]:
        return []

    def add_routes(self, app: Any, core: Any, server_config: Any) -> None:
        """``app``: the aiohttp application; ``core``: its key of the core client."""

    def core_service(self, engine: Any, post: Callable[[Any], None]) -> CoreService | None:
        """``post`` puts a command on the core loop's queue (from any thread)."""
        return None

    def metric_families(self, model: str, engine_index: str, stats: Any) -> Iterable[Any]:
        return ()

    def heartbeat_fields(self, stats: Any) -> dict[str, Any]:
        return {}

    def beside_heartbeat(self, server_config: Any, core: Any, engine_id: str
                         ) -> BesideHeartbeat | None:
        return None


_parts: dict[str, ServerPart] = {}
_loaded = False


def register(part: ServerPart) -> None:
    """A part, by its name; registering a name again replaces it (a module reloaded)."""
    _parts[part.name] = part


def parts() -> list[ServerPart]:
    """Every registered part, in registration order (the parts' modules imported first)."""
    global _loaded
    if not _loaded:
        for module in providers(PART_MODULE):
            importlib.import_module(module)
        _loaded = True
    return list(_parts.values())
