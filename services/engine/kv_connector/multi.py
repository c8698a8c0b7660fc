"""Several connectors as one (vLLM's ``MultiConnector``): a load comes from the first that can
deliver tokens for the request, saves go to all, and held blocks are freed once every connector
that held them has reported them sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.kv_connector.base import ConnectorRequest, FinishedTransfers, KVConnector
from services.protocol.kv_events import KVEvent


@dataclass(slots=True)
class MultiMetadata:
    parts: list[Any]  # each connector's metadata, in order


class MultiConnector:
    def __init__(self, connectors: list[KVConnector]) -> None:
        assert connectors
        self.connectors = connectors
        self._asked: tuple[str, int] | None = None  # (request id, the connector that answered)
        self._loading: dict[str, int] = {}  # request id -> the connector loading it
        self._holding: dict[str, set[int]] = {}  # request id -> connectors holding its blocks

    # -- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        for i, c in enumerate(self.connectors):
            num, is_async = c.get_num_new_matched_tokens(request, num_computed_tokens)
            if num:
                self._asked = (request.request_id, i)
                return num, is_async
        self._asked = None
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        chosen = None
        if num_external_tokens:
            assert self._asked is not None and self._asked[0] == request.request_id
            chosen = self._asked[1]
            self._loading[request.request_id] = chosen
        for i, c in enumerate(self.connectors):  # the others load nothing for it
            c.update_state_after_alloc(request, block_ids,
                                       num_external_tokens if i == chosen else 0)

    def build_connector_meta(self) -> MultiMetadata:
        return MultiMetadata([c.build_connector_meta() for c in self.connectors])

    def request_finished(self, request: ConnectorRequest,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        holders, params = set(), None
        for i, c in enumerate(self.connectors):
            delay, p = c.request_finished(request, block_ids)
            if delay:
                holders.add(i)
            params = params if p is None else p  # the last that has any (one, in practice)
        if holders:
            self._holding[request.request_id] = holders
        return bool(holders), params

    def take_announced(self) -> dict[str, dict[str, Any]]:
        return {rid: p for c in self.connectors for rid, p in c.take_announced().items()}

    # -- worker side -----------------------------------------------------------------------

    def start_load_kv(self, metadata: MultiMetadata) -> None:
        for c, part in zip(self.connectors, metadata.parts, strict=True):
            c.start_load_kv(part)

    def save_kv(self) -> None:
        for c in self.connectors:
            c.save_kv()

    def get_finished(self, timeout: float = 0.0) -> FinishedTransfers:
        out = self._collect(0.0)
        if not out and timeout:  # nothing yet: share the wait among them
            out = self._collect(timeout / len(self.connectors))
        return out

    def _collect(self, timeout: float) -> FinishedTransfers:
        out = FinishedTransfers()
        for i, c in enumerate(self.connectors):
            done = c.get_finished(timeout)
            for rid, num in done.recving.items():
                if self._loading.get(rid) == i:
                    del self._loading[rid]
                    out.recving[rid] = num
            for rid in done.sending:
                holders = self._holding.get(rid)
                if holders is None:
                    continue
                holders.discard(i)
                if not holders:
                    del self._holding[rid]
                    out.sending.add(rid)
        return out

    # -- observability and lifetime ----------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        return [e for c in self.connectors for e in c.take_events()]

    def snapshot_events(self) -> list[KVEvent]:
        return [e for c in self.connectors for e in c.snapshot_events()]

    def close(self) -> None:
        for c in self.connectors:
            c.close()
