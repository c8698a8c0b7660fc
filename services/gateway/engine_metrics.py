"""``GET /metrics/engines``: every live engine's ``/metrics`` in one exposition, so one scrape
of the gateway (``make serve``'s only well-known port) finds the vLLM metric families of all
the engines behind it.

Each engine's families are fetched concurrently, parsed, and merged family by family (the text
format wants a family's samples together), each sample labelled ``engine_id``; an engine that
does not answer is left out and shows as ``pagoda_gateway_engine_scrape_up{engine_id} 0``.
Engines export their own ``/metrics`` too: scrape either, not both, or samples count twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Iterator

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from services.gateway.router_client import EngineInfo, RouterUnavailable
from services.gateway.state import STATE

logger = logging.getLogger(__name__)

_SCRAPE_TIMEOUT_S = 2.0
ENGINE_LABEL = "engine_id"


async def engine_metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    try:
        engines = await state.router.engines()
    except RouterUnavailable as exc:
        logger.warning("router /engines unavailable for /metrics/engines: %s", exc)
        engines = []
    texts = await asyncio.gather(*(_scrape(state.upstreams.session, e) for e in engines))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(zip(engines, texts, strict=True))))
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _scrape(session: aiohttp.ClientSession, engine: EngineInfo) -> str | None:
    try:
        timeout = aiohttp.ClientTimeout(total=_SCRAPE_TIMEOUT_S)
        async with session.get(engine.url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            if resp.status == 200:
                return await resp.text()
            logger.warning("engine=%s /metrics answered %d", engine.engine_id, resp.status)
    except (aiohttp.ClientError, TimeoutError) as exc:
        logger.warning("engine=%s /metrics failed: %s", engine.engine_id, exc or "timeout")
    return None


class _Merged(Collector):
    def __init__(self, scraped: list[tuple[EngineInfo, str | None]]) -> None:
        self._scraped = scraped

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("pagoda_gateway_engine_scrape_up",
                               "1 if the engine's /metrics answered this scrape.",
                               labels=[ENGINE_LABEL])
        merged: dict[str, Metric] = {}
        for engine, text in self._scraped:
            up.add_metric([engine.engine_id], 0.0 if text is None else 1.0)
            if text is not None:
                _merge(merged, engine.engine_id, text_string_to_metric_families(text))
        yield up
        yield from merged.values()


def _merge(merged: dict[str, Metric], engine_id: str, families: Iterable[Metric]) -> None:
    for family in families:
        into = merged.get(family.name)
        if into is None:
            into = merged[family.name] = Metric(family.name, family.documentation, family.type)
        for s in family.samples:
            into.add_sample(s.name, {**s.labels, ENGINE_LABEL: engine_id}, s.value, s.timestamp)
