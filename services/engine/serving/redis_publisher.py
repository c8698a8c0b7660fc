"""Engine -> Redis: a heartbeat (liveness + load) and the block manager's KV events.

Redis being down never affects serving: a failed publish is logged and retried on the next
tick; events that could not be sent are kept (bounded) and sent later in order.

Whenever Redis does not know this engine (its first heartbeat, a Redis restart that lost the
index, a heartbeat that lapsed) the engine re-announces its whole prefix cache: "cleared"
(dropping entries a previous run under the same id left behind) and then every cached hash.
So the routers' index is rebuilt within two heartbeats of Redis coming back.

What goes to Redis names blocks by their chain hashes only: a stored block's token ids (every
tenant's prompt, in clear) are cut from the events unless the operator asks for them
(``--kv-events-token-ids``, for a subscriber of the events channel that reads tokens). The
routers' index never needs them: it keys by block hash.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from services.common.redis_index import KVIndexPublisher
from services.engine.features import server_parts
from services.engine.serving.core_client import CoreClient
from services.protocol.kv_events import KVEvent
from services.protocol.messages import EngineHeartbeat

logger = logging.getLogger(__name__)

_MAX_EVENTS_PER_TICK = 50_000


class EnginePublisher:
    def __init__(self, server_config, core: CoreClient) -> None:
        self.cfg = server_config
        self.core = core
        self.engine_id = server_config.resolved_engine_id()
        self.url = server_config.resolved_url()
        self.publisher = KVIndexPublisher.from_url(server_config.redis_url)
        self.parts = server_parts.parts()
        # The features' work beside the heartbeats (the adapter registry's sync).
        self.beside = [task for part in self.parts
                       if (task := part.beside_heartbeat(server_config, core, self.engine_id))]
        self._pending: list = []
        self._failing = False

    async def publish_once(self) -> None:
        core = self.core
        if not core.is_ready or core.stats is None:
            return
        info = core.info
        # Beside the heartbeat: only the first heartbeat waits (a bounded time) for the first
        # sync, so an engine is routable with what its peers have; never one past its TTL.
        for task in self.beside:
            await task.tick(self.cfg.heartbeat_ttl_s / 2)
        taken = core.kv_events.take(_MAX_EVENTS_PER_TICK - len(self._pending))
        self._pending.extend(taken if self.cfg.kv_events_token_ids else without_tokens(taken))
        s = core.stats
        contributed = {k: v for part in self.parts for k, v in part.heartbeat_fields(s).items()}
        hb = EngineHeartbeat(
            engine_id=self.engine_id,
            url=self.url,
            model=info.model_name,
            block_size=info.block_size,
            hash_algorithm=info.hash_algorithm,
            running=s.num_running,
            # Requests that arrived since the last step are waiting too: a heartbeat sent at
            # once on their arrival must count them, or routers would see a stale, lower load.
            waiting=max(s.num_waiting, core.num_accepted - s.num_running),
            kv_usage=min(max(s.kv_usage, 0.0), 1.0),
            free_blocks=s.num_free_blocks,
            total_blocks=s.num_total_blocks,
            timestamp=time.time(),
            max_model_len=info.max_model_len,
            step_ms=round(core.step_ms, 3),
            kv_role=info.kv_role,
            kv_transfer_address=info.kv_transfer_address,
            kv_layout=info.kv_layout,
            openai_port=self.cfg.openai_port,
            **contributed,
        )
        try:
            if self._pending:
                await self.publisher.apply_events(self.engine_id, info.model_name, self._pending)
                self._pending = []
            known = await self.publisher.publish_heartbeat(hb, self.cfg.heartbeat_ttl_s)
            if not known:
                logger.info("redis does not know engine %s; re-announcing its prefix cache",
                            self.engine_id)
                core.request_kv_resync()
            if self._failing:
                logger.info("redis reachable again; publishing resumed")
            self._failing = False
        except Exception as exc:  # noqa: BLE001 -- whatever Redis does, keep serving; retry
            if not self._failing:
                logger.warning("redis publish failed: %s", exc)
            self._failing = True

    async def leave(self) -> None:
        """Graceful shutdown: stop being routable before draining."""
        info = self.core.info
        if info is None:
            return
        try:
            await self.publisher.remove_engine(self.engine_id, info.model_name)
        except Exception as exc:  # noqa: BLE001 -- leaving must not fail the shutdown
            logger.warning("redis remove_engine failed: %s", exc)

    async def close(self) -> None:
        for task in self.beside:
            await task.close()
        await self.leave()
        await self.publisher.aclose()


def without_tokens(events: Iterable[KVEvent]) -> list[KVEvent]:
    """The events with no token ids (hashes, parents, media and kinds unchanged)."""
    return [dataclasses.replace(e, token_ids=()) if e.token_ids else e for e in events]

