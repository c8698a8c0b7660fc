"""Holding requests while their model has no ready engine: scale from zero (KEDA is starting
one), or a rollout that briefly leaves none.

``EngineWait.route(model, ask)`` asks the router once (``ask(0.0)``). When the router answers
that no engine of the model is live, the request is held: it asks again every
``ENGINE_WAIT_POLL_S`` with the seconds it has waited (``RouteRequest.waited_s``, which is how
the router counts it in its demand metrics), and goes on as soon as an engine is there. Bounds,
per model: at most ``max_requests`` engine requests held at once (the next one gets a 429), and
at most ``timeout_s`` seconds each (then a 503). Both carry ``Retry-After`` and OpenAI's error
body. ``timeout_s`` 0 turns holding off: a 503 at once, as before.

Only "no live engine" holds a request. A router that cannot be reached, or engines that all
failed this request, are answered at once, as without holding. A client that hangs up while
held leaves at once (its handler is cancelled), and the router stops counting it a few poll
intervals later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.gateway.metrics import GatewayMetrics
from services.protocol.messages import ENGINE_WAIT_POLL_S, RouteResponse
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

NO_ENGINE_CODE = "no_engine_available"  # RouterClient.route's error when no engine is live
RETRY_AFTER_S = 10  # what a refused client is told to wait before trying again

Ask = Callable[[float], Awaitable[RouteResponse]]


class EngineWait:
    def __init__(self, timeout_s: float, max_requests: int, metrics: GatewayMetrics,
                 poll_s: float = ENGINE_WAIT_POLL_S) -> None:
        self.timeout_s = timeout_s
        self.max_requests = max_requests
        self._metrics = metrics
        self._poll_s = poll_s
        self._held: dict[str, int] = {}

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    async def route(self, model: str, ask: Ask) -> RouteResponse:
        """The router's answer for one engine request, waiting for an engine if need be.
        Raises OpenAIError: 429 or 503 with ``retry_after`` when the bounds are reached."""
        try:
            return await ask(0.0)
        except OpenAIError as exc:
            if exc.code != NO_ENGINE_CODE:
                raise
            if self.timeout_s <= 0:
                raise self._refused(model, 503, exc.message) from None
        if self.held(model) >= self.max_requests:
            raise self._refused(
                model, 429, f"{self.max_requests} requests are already waiting for an engine of "
                f"model {model!r} to start; retry later")
        return await self._hold(model, ask)

    async def _hold(self, model: str, ask: Ask) -> RouteResponse:
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._held[model] = self.held(model) + 1
        gauge = self._metrics.waiting_for_engine.labels(model)
        gauge.inc()
        if self._held[model] == 1:
            logger.info("no ready engine for model=%s; holding requests up to %.0fs", model,
                        self.timeout_s)
        try:
            while (waited := loop.time() - start) < self.timeout_s:
                await asyncio.sleep(min(self._poll_s, self.timeout_s - waited))
                try:
                    return await ask(max(loop.time() - start, 1e-3))
                except OpenAIError as exc:
                    if exc.code != NO_ENGINE_CODE:
                        raise
            raise self._refused(model, 503, f"no engine of model {model!r} became ready within "
                                f"{self.timeout_s:g} seconds; retry later")
        finally:
            gauge.dec()
            self._held[model] -= 1
            if not self._held[model]:
                del self._held[model]

    def _refused(self, model: str, status: int, message: str) -> OpenAIError:
        self._metrics.engine_wait_refused.labels(model, str(status)).inc()
        return OpenAIError(message, status=status, code=NO_ENGINE_CODE,
                           retry_after=RETRY_AFTER_S)
