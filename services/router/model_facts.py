"""What the endpoint picker must know of a model before it can hash a prompt: the base model a
request's ``model`` names (itself, or the base of a LoRA adapter its engines serve), the
engines' block size and hash function, and the adapter's version, all read from the engines'
heartbeats as Pagoda's gateway reads them from ``/engines``.

Answers come from the heartbeats the index remembers from its lookups (no Redis call on the
hot path); a name seen nowhere makes one refresh of every model's heartbeats, at most once per
``refresh_s``, so unknown names cannot turn each request into a scan.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from services.protocol.block_hash import AdapterKey, HashAlgorithm
from services.protocol.messages import EngineHeartbeat
from services.router.index import RouterIndex


@dataclass(frozen=True, slots=True)
class ModelFacts:
    model: str  # the base model: the engines' heartbeat model, the index's namespace
    block_size: int
    hash_algorithm: HashAlgorithm
    adapter: AdapterKey | None  # the LoRA adapter the request's model names, if any


class ModelCatalog:
    def __init__(self, index: RouterIndex, refresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._index = index
        self._refresh_s = refresh_s
        self._clock = clock
        self._refreshed = -refresh_s
        self._refreshing: asyncio.Future[None] | None = None

    async def resolve(self, name: str) -> ModelFacts | None:
        """The facts for a request's ``model``; None when no live engine serves it."""
        facts = self._lookup(name)
        if facts is None and self._refreshing is not None:
            # A refresh another request started: wait for it (its interval has not passed,
            # but its answer is not in yet: the first requests after a start arrive together).
            await asyncio.shield(self._refreshing)
            facts = self._lookup(name)
        if facts is None and self._clock() - self._refreshed >= self._refresh_s:
            self._refreshing = asyncio.ensure_future(self._refresh())
            try:
                await asyncio.shield(self._refreshing)
            finally:
                self._refreshing = None
            facts = self._lookup(name)
        return facts

    def _lookup(self, name: str) -> ModelFacts | None:
        beats = self._index.heartbeats(name)
        if beats:
            return _facts(name, beats, None)
        for model in self._index.cached_models():
            beats = self._index.heartbeats(model)
            versions = [a.version for hb in beats for a in hb.adapters if a.name == name]
            if versions:
                version = Counter(versions).most_common(1)[0][0]  # as the gateway: most report
                return _facts(model, beats, AdapterKey(name, version))
        return None

    async def _refresh(self) -> None:
        self._refreshed = self._clock()
        for model in await self._index.models() or []:
            await self._index.lookup(model, (), timed=False)  # remembers its heartbeats


def _facts(model: str, beats: list[EngineHeartbeat], adapter: AdapterKey | None) -> ModelFacts:
    common = Counter((hb.block_size, hb.hash_algorithm) for hb in beats).most_common(1)[0][0]
    return ModelFacts(model, common[0], HashAlgorithm(common[1]), adapter)
