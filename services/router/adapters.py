"""LoRA adapters in routing: which engines may serve a request's adapter, how much readier
each one is, and the adapter registry's HTTP API.

Each engine's heartbeat lists its adapters and where it holds each one
(``services.protocol.lora_api``). For a request naming an adapter, engines that do not have it
are left out when any engine has it (the gateway answers 404 before routing when none does).
The prefix policy then adds ``ADAPTER_WEIGHT x affinity`` to each candidate's score, the
affinity being llm-d's: 1.0 for an engine holding the adapter in a device slot (no copy
before the first step), 0.8 in host memory (a copy into a slot), 0.6 only registered (read from
disk first), 0 without it. So, prefixes being equal, traffic for an adapter goes where it is
loaded, weighed against load as a prefix hit is, and the policy's hot-spot guard spreads a
burst for one adapter over the other engines that have it.

``GET/POST/DELETE /adapters``: the registry of runtime-loaded adapters in Redis
(``services.common.lora_registry``), written by the gateway's load and unload; ``GET`` shows an
entry that failed to load on an engine as ``quarantined`` (its error and the engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from aiohttp import web

from services.common.http_errors import json_error
from services.common.lora_registry import AdapterRegistry
from services.protocol.lora_api import (
    IN_HOST,
    IN_SLOT,
    ON_DISK,
    REGISTRY_PATH,
    RegisterAdapter,
    UnregisterAdapter,
)
from services.protocol.wire import BadRequest

if TYPE_CHECKING:
    from services.router.index import IndexSnapshot
    from services.router.policies import Candidate

ADAPTER_WEIGHT = 1.0
NOT_HELD = -1
_AFFINITY = {IN_SLOT: 1.0, IN_HOST: 0.8, ON_DISK: 0.6}

REGISTRY = web.AppKey("adapter_registry", AdapterRegistry)


def affinity(residency: int) -> float:
    return _AFFINITY.get(residency, 0.0)


def with_adapter(candidates: Sequence[Candidate], snapshot: IndexSnapshot, name: str
                 ) -> list[Candidate]:
    """``candidates`` with each one's residency of adapter ``name``; those without it are left
    out unless none has it."""
    held: dict[str, int] = {}
    for view in snapshot.engines:
        for a in view.heartbeat.adapters:
            if a.name == name:
                held[view.heartbeat.engine_id] = a.residency
    out = [replace(c, adapter=held.get(c.engine_id, NOT_HELD)) for c in candidates]
    having = [c for c in out if c.adapter != NOT_HELD]
    return having or out


# -- the registry's API ---------------------------------------------------------------------------


async def handle_list(request: web.Request) -> web.Response:
    model = request.query.get("model")
    if not model:
        return json_error(400, "model is required", "model")
    registry = request.app[REGISTRY]
    try:
        entries = await registry.entries(model)
        generation = await registry.generation(model)
        bad = await registry.quarantined(model)
    except Exception as exc:  # noqa: BLE001 -- Redis down: the registry is unavailable
        return json_error(503, f"the adapter registry is unavailable: {exc}")
    listed = []
    for name, path in sorted(entries.items()):
        item = {"lora_name": name, "lora_path": path}
        q = bad.get(name)
        if q is not None and q.path == path:  # no engine loads it until registered again
            item["quarantined"] = {"error": q.error, "engine": q.engine}
        listed.append(item)
    return web.json_response({"adapters": listed, "generation": generation})


async def handle_register(request: web.Request) -> web.Response:
    try:
        body = RegisterAdapter.from_json(await request.read())
    except BadRequest as exc:
        return json_error(400, str(exc), exc.param)
    try:
        done = await request.app[REGISTRY].register(body.model, body.lora_name, body.lora_path)
    except Exception as exc:  # noqa: BLE001
        return json_error(503, f"the adapter registry is unavailable: {exc}")
    if not done:
        return json_error(409, f"the adapter {body.lora_name!r} is registered with another "
                          "path", "lora_name")
    return web.json_response({"registered": body.lora_name})


async def handle_unregister(request: web.Request) -> web.Response:
    try:
        body = UnregisterAdapter.from_json(await request.read())
    except BadRequest as exc:
        return json_error(400, str(exc), exc.param)
    try:
        removed = await request.app[REGISTRY].unregister(body.model, body.lora_name)
    except Exception as exc:  # noqa: BLE001
        return json_error(503, f"the adapter registry is unavailable: {exc}")
    return web.json_response({"unregistered": body.lora_name, "was_registered": removed})


def add_routes(app: web.Application) -> None:
    app.router.add_get(REGISTRY_PATH, handle_list)
    app.router.add_post(REGISTRY_PATH, handle_register)
    app.router.add_delete(REGISTRY_PATH, handle_unregister)
