"""The engine server's adapter endpoints (``services.protocol.lora_api``): load and unload a
LoRA adapter while the engine runs, and list the adapters it serves. Internal, as
``/internal/generate``: the gateway's ``/v1/load_lora_adapter`` fans out to them and the Redis
registry's sync calls them too; an OpenAI front pinned to the engine (``--engine-url``) reads
the list, which is the heartbeat's (``served_adapters``). Like
every engine route but /health and /metrics they require the internal credential (the server's
``internal_auth`` middleware), so no pod without it can load or unload adapters.

The request travels to the engine core as an ``AdapterCommand`` and its answer comes back with
a step's outputs; a path is confined to ``--lora-roots`` in the core before anything is read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from services.common.http_errors import json_error
from services.engine.lora.commands import (
    LOAD,
    UNLOAD,
    AdapterCommand,
    AdapterCore,
    AdapterReply,
)
from services.protocol.lora_api import (
    ADAPTERS_PATH,
    LOAD_PATH,
    MAX_ADAPTERS,
    UNLOAD_PATH,
    AdapterStatus,
    LoadAdapter,
    UnloadAdapter,
)
from services.protocol.wire import BadRequest

if TYPE_CHECKING:  # annotations only: nothing here touches the manager itself
    from services.engine.lora.manager import LoRAStats


def add_routes(app: web.Application, core: web.AppKey[AdapterCore], roots: tuple[str, ...]
               ) -> None:
    """Adds the two endpoints; ``core``: the app's key of its core client (set once the app
    starts)."""

    async def load(request: web.Request) -> web.Response:
        try:
            body = LoadAdapter.from_json(await request.read())
        except BadRequest as exc:
            return json_error(400, str(exc), exc.param)
        cmd = AdapterCommand(LOAD, body.lora_name, body.lora_path, roots)
        return await run(request.app[core], cmd)

    async def unload(request: web.Request) -> web.Response:
        try:
            body = UnloadAdapter.from_json(await request.read())
        except BadRequest as exc:
            return json_error(400, str(exc), exc.param)
        return await run(request.app[core], AdapterCommand(UNLOAD, body.lora_name))

    async def listed(request: web.Request) -> web.Response:
        client = request.app[core]
        if not client.is_ready or client.stats is None:
            return json_error(503, "engine is not ready")
        adapters = served_adapters(client.stats.lora)
        return web.json_response({"adapters": [a.to_dict() for a in adapters]})

    app.router.add_post(LOAD_PATH, load)
    app.router.add_post(UNLOAD_PATH, unload)
    app.router.add_get(ADAPTERS_PATH, listed)


def served_adapters(lora: LoRAStats | None) -> list[AdapterStatus]:
    """The adapters the engine serves, as heartbeats and ``ADAPTERS_PATH`` list them: the
    readiest first, at most ``MAX_ADAPTERS``."""
    if lora is None:
        return []
    ranked = sorted(lora.adapters, key=lambda a: (-a.residency, a.name))[:MAX_ADAPTERS]
    return [AdapterStatus(a.name, a.version, a.residency, a.path) for a in ranked]


async def run(core: AdapterCore, cmd: AdapterCommand) -> web.Response:
    if not core.is_ready:
        return json_error(503, "engine is not ready")
    reply = await core.command(cmd)
    if reply.status != 200:
        return json_error(reply.status, reply.message, reply.param)
    return web.json_response(_body(reply))


def _body(reply: AdapterReply) -> dict[str, Any]:
    out: dict[str, Any] = {"message": reply.message}
    a = reply.adapter
    if a is not None:
        out.update(lora_name=a.name, lora_path=a.path, version=a.version)
    return out
