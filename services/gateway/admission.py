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

Bytes: a held request keeps its body (and what was made of it) in the gateway's memory, so a
count alone does not bound it (256 held 8 MiB bodies are 2 GiB). Each held engine request
carries a ``HoldCost``: its share of the request's body bytes and the caller's tenant (the API
key's one-way tenant id; None when keys are off). Per model at most ``max_bytes`` and per
tenant, over all models, at most ``max_tenant_bytes`` may be held; past either bound, the 429
of the count bound. The tenant bound keeps one tenant from filling a model's buffer for every
other. Messages and logs name neither the key nor the tenant id.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from services.gateway.metrics import GatewayMetrics
from services.protocol.messages import ENGINE_WAIT_POLL_S, RouteResponse
from services.protocol.openai import OpenAIError

logger = logging.getLogger(__name__)

NO_ENGINE_CODE = "no_engine_available"  # RouterClient.route's error when no engine is live
RETRY_AFTER_S = 10  # what a refused client is told to wait before trying again

Ask = Callable[[float], Awaitable[RouteResponse]]
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class HoldCost:
    """What one engine request would keep in memory while held."""

    tenant: str | None  # the API key's tenant id; None: keys are off (no tenant bound)
    nbytes: int  # its share of the request's body bytes (a body split over its choices)

    def __post_init__(self) -> None:
        assert self.nbytes >= 0, self.nbytes


FREE = HoldCost(None, 0)


class EngineWait:
    def __init__(self, timeout_s: float, max_requests: int, metrics: GatewayMetrics,
                 poll_s: float = ENGINE_WAIT_POLL_S, max_bytes: int = 128 * MIB,
                 max_tenant_bytes: int = 32 * MIB) -> None:
        self.timeout_s = timeout_s
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.max_tenant_bytes = max_tenant_bytes
        self._metrics = metrics
        self._poll_s = poll_s
        self._held: Counter[str] = Counter()  # per model
        self._held_bytes: Counter[str] = Counter()  # per model
        self._tenant_bytes: Counter[str] = Counter()  # per tenant, every model

    def held(self, model: str) -> int:
        return self._held[model]

    def held_bytes(self, model: str) -> int:
        return self._held_bytes[model]

    async def route(self, model: str, ask: Ask, cost: HoldCost = FREE) -> RouteResponse:
        """The router's answer for one engine request, waiting for an engine if need be.
        Raises OpenAIError: 429 or 503 with ``retry_after`` when the bounds are reached."""
        try:
            return await ask(0.0)
        except OpenAIError as exc:
            if exc.code != NO_ENGINE_CODE:
                raise
            if self.timeout_s <= 0:
                raise self._refused(model, 503, exc.message) from None
        full = self._full(model, cost)
        if full is not None:
            raise self._refused(model, 429, f"{full} already waiting for an engine of model "
                                f"{model!r} to start; retry later")
        return await self._hold(model, ask, cost)

    def _full(self, model: str, cost: HoldCost) -> str | None:
        """Which bound holding one more request would pass (as the client is told), or None."""
        if self._held[model] >= self.max_requests:
            return f"{self.max_requests} requests are"
        if self._held_bytes[model] + cost.nbytes > self.max_bytes:
            return f"{self.max_bytes} bytes of requests are"
        if cost.tenant is not None and (
                self._tenant_bytes[cost.tenant] + cost.nbytes > self.max_tenant_bytes):
            return f"{self.max_tenant_bytes} bytes of this API key's requests are"
        return None

    async def _hold(self, model: str, ask: Ask, cost: HoldCost) -> RouteResponse:
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._take(model, cost, +1)
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
            self._take(model, cost, -1)

    def _take(self, model: str, cost: HoldCost, sign: int) -> None:
        """Counts a request in (+1) or out (-1) of the buffer; empty entries go (a tenant or
        model seen once must not stay in memory)."""
        counts = [(self._held, model, 1), (self._held_bytes, model, cost.nbytes)]
        if cost.tenant is not None:
            counts.append((self._tenant_bytes, cost.tenant, cost.nbytes))
        for counter, key, n in counts:
            counter[key] += sign * n
            assert counter[key] >= 0, key
            if not counter[key]:
                del counter[key]

    def _refused(self, model: str, status: int, message: str) -> OpenAIError:
        self._metrics.engine_wait_refused.labels(model, str(status)).inc()
        return OpenAIError(message, status=status, code=NO_ENGINE_CODE,
                           retry_after=RETRY_AFTER_S)
