"""The gateway pinned to one engine, with no router (``--engine-url``): the OpenAI front of an
engine pod, running beside the engine in that pod. A Gateway API InferencePool's endpoint
picker (the router's ext_proc) has already chosen the pod; this only turns the OpenAI request
into the engine's internal API, with the gateway's own handling (auth, templates, tokenizing,
SSE, the internal credential). It answers what ``RouterClient`` does (``Routing``):

- ``route``: that engine, while its last ``/health`` said it serves the request's model. When
  it has failed the request (``exclude``), no other engine is left to try: a 503, as vLLM's
  server answers when its engine fails.
- ``engines``: the engine's ``GET /health`` (model, block size, context length) and its LoRA
  adapters (``GET /internal/lora/adapters``, what its heartbeat reports: ``--lora-modules``
  and runtime loads) as one ``EngineInfo``, so a request naming an adapter is served as
  through the router, and ``/v1/models`` lists them. Loading, draining or unreachable is
  ``RouterUnavailable``: ``/ready`` turns 503 and the pod leaves the pool's ready endpoints.
- ``loads``: None, unknown: in front of a pool, flow control runs in the picker.
- ``call_json``: the adapter registry's calls (``lora_admin``, with
  ``--allow-runtime-lora-updating``). There is no registry here: a load is this engine's
  alone, so registering is a no-op that succeeds and the load goes to the engine
  (``lora_admin``'s fan-out, to this one engine, with the same checks and admin keys).
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import aiohttp

from services.gateway.admission import NO_ENGINE_CODE
from services.gateway.router_client import EngineInfo, RouterUnavailable
from services.protocol.lora_api import ADAPTERS_PATH, REGISTRY_PATH
from services.protocol.messages import RouteRequest, RouteResponse
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

HEALTH_PATH = "/health"
PINNED = "pinned"  # RouteResponse.reason and .policy


class LocalEngine:
    name = "the engine"

    def __init__(self, session: aiohttp.ClientSession, url: str, timeout: float,
                 engine_id: str | None = None) -> None:
        """``engine_id``: what logs and the response header name the engine; default the
        host's name, which in a pod is the pod's name: the chart's ``--engine-id``."""
        self.url = url.rstrip("/")
        self.engine_id = engine_id or socket.gethostname()
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._live: EngineInfo | None = None  # the last /health, when it was 200

    async def route(self, req: RouteRequest) -> RouteResponse:
        live = self._live
        if live is None:  # not ready at the last poll: it may be now
            try:
                live = (await self.engines())[0]
            except RouterUnavailable as exc:
                raise OpenAIError(f"no engine available for model {req.model!r}: {exc}",
                                  status=503, code=NO_ENGINE_CODE) from None
        if live.model != req.model:
            raise OpenAIError(f"no engine available for model {req.model!r} (this engine "
                              f"serves {live.model!r})", status=503, code=NO_ENGINE_CODE)
        if live.engine_id in req.exclude:
            raise OpenAIError("the engine could not serve the request", status=503,
                              code="engine_unavailable")
        return RouteResponse(live.engine_id, live.url, 0, PINNED, PINNED)

    async def engines(self) -> list[EngineInfo]:
        try:
            self._live = await self._health()
        except RouterUnavailable:
            self._live = None
            raise
        return [self._live]

    async def _health(self) -> EngineInfo:
        try:
            async with self._session.get(self.url + HEALTH_PATH, timeout=self._timeout) as resp:
                status = resp.status
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise RouterUnavailable(f"the engine at {self.url} does not answer "
                                    f"({type(exc).__name__})") from None
        if not isinstance(body, dict):
            raise RouterUnavailable(f"the engine's {HEALTH_PATH} is not a JSON object")
        if status != 200:
            raise RouterUnavailable(f"the engine is not serving ({status}: "
                                    f"{str(body.get('status'))[:40]})")
        adapters = await self._adapters()
        info = EngineInfo.from_dict({**body, "engine_id": self.engine_id, "url": self.url,
                                     "adapters": adapters})
        if info is None:
            raise RouterUnavailable(f"the engine's {HEALTH_PATH} lacks its model or block size")
        return info

    async def _adapters(self) -> list[Any]:
        """The engine's adapters (raw rows, which ``EngineInfo.from_dict`` checks). An engine
        older than the route (404) serves none that this front can name."""
        url = self.url + ADAPTERS_PATH
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status == 404:
                    return []
                if resp.status != 200:  # refused our credential, or not ready after all
                    raise RouterUnavailable(f"the engine's {ADAPTERS_PATH} answered "
                                            f"{resp.status}")
                body = await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            raise RouterUnavailable(f"the engine at {self.url} does not answer "
                                    f"({type(exc).__name__})") from None
        rows = body.get("adapters") if isinstance(body, dict) else None
        return rows if isinstance(rows, list) else []

    async def loads(self, model: str) -> None:
        return None

    async def call_json(self, method: str, path: str, body: Any = None
                        ) -> tuple[int, dict[str, Any]]:
        """The registry's answers when there is none: registering succeeds and changes
        nothing (``lora_admin`` then loads on this engine), and nothing was ever registered.
        Other engines of the pool are not reached: a runtime load through a pinned front is
        this pod's alone, as vLLM's ``/v1/load_lora_adapter`` is its server's."""
        if path != REGISTRY_PATH or method not in ("POST", "DELETE"):
            raise RouterUnavailable(f"no router beside a pinned engine for {method} {path}")
        return 200, {} if method == "POST" else {"was_registered": False}
