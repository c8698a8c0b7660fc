"""vLLM's runtime adapter API: ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``
and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` (optional ``base_model_name``: which
served model; default: the request-less default, as for generation).

Who may: it exists only with ``--allow-runtime-lora-updating`` (or
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``; otherwise a 404, as vLLM has no such route then),
and takes an admin key (``--admin-api-key``) whenever the gateway has keys: any other key is a
403. A gateway without any key is open, as vLLM's server is.

What a load does: a name already served (or a base model's) is a 400, as vLLM's; a
``lora_path`` with ``..`` is a 400 before anything else (each engine confines the path to its
``--lora-roots``, walking from the root with no symlink followed, and refuses the rest with a
400 naming ``lora_path``).
The adapter is registered in the router's registry (Redis) first, so an engine that starts or
restarts meanwhile loads it too, then loaded on every live engine of the model at once; the
answer comes when all have it (vLLM's ``Success: ...`` text). If every engine refuses it, it
is unregistered and the engines' 400 is the answer; if only some fail, it stays registered
(they retry when they restart or the registry changes) and the answer is a 502 naming them.
Unload: unknown is a 404; else unregistered, then unloaded on every engine.

Pinned to one engine (``--engine-url``, an engine pod's OpenAI front) there is no registry
(``LocalEngine.call_json``): the same checks and keys, and the load or unload reaches that one
engine, as vLLM's own server loads an adapter on itself. Other pods of the pool do not get it.
An engine whose model's registry changes later (a load or unload through a gateway with a
router) drops the runtime adapters the registry does not hold: use one way per model.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import PurePosixPath
from typing import Any

import aiohttp
from aiohttp import web

from services.common import internal_auth
from services.gateway.errors import read_json_body
from services.gateway.models import ServedModel
from services.gateway.router_client import AdapterInfo, EngineInfo, RouterUnavailable
from services.gateway.state import MODEL_LABEL, STATE, GatewayState
from services.protocol.lora_api import LOAD_PATH, REGISTRY_PATH, UNLOAD_PATH
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"
_ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=120)


def add_routes(app: web.Application) -> None:
    app.router.add_post(LOAD_ROUTE, load_adapter)
    app.router.add_post(UNLOAD_ROUTE, unload_adapter)


async def load_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _allowed(request, state)
    body = await read_json_body(request, state.config.max_body_bytes,
                                state.config.body_read_timeout)
    name, model = _target(state, body)
    path = _text(body, "lora_path")
    if ".." in PurePosixPath(path).parts or "\x00" in path:
        raise OpenAIError(f"lora_path must not contain '..': {path!r}", param="lora_path")
    request[MODEL_LABEL] = model.name
    if name in model.adapters or name in state.models.models:
        raise _already(name)
    engines = await _engines(state, model)
    status, answer = await _router(state, "POST", {"model": model.name, "lora_name": name,
                                                   "lora_path": path})
    if status == 409:
        raise _already(name)
    if status != 200:
        raise OpenAIError(f"the adapter registry refused: {answer}", status=503)
    results = await _fan_out(state, engines, LOAD_PATH, {"lora_name": name, "lora_path": path})
    failed = {e: r for e, r in results.items() if r[0] != 200}
    if len(failed) == len(results):  # nobody has it: take it back, and say why
        await _router(state, "DELETE", {"model": model.name, "lora_name": name})
        code, err = next(iter(failed.values()))
        if code == 409:
            raise _already(name)
        raise OpenAIError(err.get("message", "the engines refused the adapter"),
                          status=400 if 400 <= code < 500 else 502, param=err.get("param"))
    ok = next(r[1] for r in results.values() if r[0] == 200)
    model.adapters[name] = AdapterInfo(name, ok["version"], ok.get("lora_path", path))
    if failed:
        shown = "; ".join(f"{e}: {r[1].get('message', r[0])}" for e, r in failed.items())
        raise OpenAIError(f"the adapter {name!r} loaded on {len(results) - len(failed)} of "
                          f"{len(results)} engines; failed on {shown}", status=502)
    logger.info("adapter loaded name=%s model=%s engines=%d", name, model.name, len(results))
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _allowed(request, state)
    body = await read_json_body(request, state.config.max_body_bytes,
                                state.config.body_read_timeout)
    name, model = _target(state, body)
    request[MODEL_LABEL] = model.name
    status, answer = await _router(state, "DELETE", {"model": model.name, "lora_name": name})
    if status != 200:
        raise OpenAIError(f"the adapter registry refused: {answer}", status=503)
    if name not in model.adapters and not answer.get("was_registered"):
        raise OpenAIError(f"The lora adapter '{name}' cannot be found.", status=404,
                          param="lora_name")
    engines = await _engines(state, model)
    results = await _fan_out(state, engines, UNLOAD_PATH, {"lora_name": name})
    model.adapters.pop(name, None)
    failed = {e: r for e, r in results.items() if r[0] not in (200, 404)}
    if failed:
        shown = "; ".join(f"{e}: {r[1].get('message', r[0])}" for e, r in failed.items())
        raise OpenAIError(f"the adapter {name!r} could not be unloaded on {shown}", status=502)
    logger.info("adapter unloaded name=%s model=%s", name, model.name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


# -- checks ---------------------------------------------------------------------------------------


def _allowed(request: web.Request, state: GatewayState) -> None:
    config = state.config
    if not config.allow_runtime_lora_updating:
        raise OpenAIError("runtime LoRA adapter loading is off (start the gateway with "
                          "--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING"
                          "=true)", status=404)
    if not config.api_keys and not config.admin_api_keys:
        return  # an open gateway, as vLLM's server without --api-key
    _, _, token = request.headers.get("Authorization", "").partition(" ")
    given = token.strip().encode()
    admin = False
    for key in config.admin_api_keys:  # every key compared: timing reveals nothing
        admin |= hmac.compare_digest(given, key.encode())
    if not admin:
        raise OpenAIError("loading and unloading adapters needs an admin API key",
                          status=403, code="permission_denied")


def _target(state: GatewayState, body: Any) -> tuple[str, ServedModel]:
    if not isinstance(body, dict):
        raise OpenAIError("the body must be a JSON object")
    name = _text(body, "lora_name")
    base = body.get("base_model_name", body.get("model"))
    model = state.models.resolve_optional(base, state.config.default_model)
    return name, model


def _text(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value.strip():
        raise OpenAIError(f"{field} must be a non-empty string", param=field)
    return value.strip()


def _already(name: str) -> OpenAIError:
    return OpenAIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")


# -- calls ---------------------------------------------------------------------------------------


async def _engines(state: GatewayState, model: ServedModel) -> list[EngineInfo]:
    try:
        engines = [e for e in await state.router.engines() if e.model == model.name]
    except RouterUnavailable as exc:
        raise OpenAIError(f"the router is unavailable: {exc}", status=503) from None
    if not engines:
        raise OpenAIError(f"no live engine serves {model.name!r}", status=503)
    return engines


async def _router(state: GatewayState, method: str, body: dict[str, Any]
                  ) -> tuple[int, dict[str, Any]]:
    try:
        return await state.router.call_json(method, REGISTRY_PATH, body)
    except RouterUnavailable as exc:
        raise OpenAIError(f"the router is unavailable: {exc}", status=503) from None


async def _fan_out(state: GatewayState, engines: list[EngineInfo], path: str,
                   body: dict[str, Any]) -> dict[str, tuple[int, dict[str, Any]]]:
    """Each engine's (status, JSON answer), all at once; an unreachable engine is a 503."""
    session = state.upstreams.session

    async def one(engine: EngineInfo) -> tuple[int, dict[str, Any]]:
        try:
            async with session.post(engine.url.rstrip("/") + path, json=body,
                                    timeout=_ENGINE_TIMEOUT) as resp:
                if internal_auth.refused(resp.status):  # not the admin's fault: a 502
                    return 502, {"message": "refused the gateway's internal credential"}
                data = await resp.json(content_type=None)
                if isinstance(data, dict) and isinstance(data.get("error"), dict):
                    data = data["error"]
                return resp.status, data if isinstance(data, dict) else {}
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            return 503, {"message": f"unreachable ({type(exc).__name__})"}

    answers = await asyncio.gather(*(one(e) for e in engines))
    return {e.engine_id: a for e, a in zip(engines, answers, strict=True)}
