"""Prefills streamed to their decode engine while they run (P/D with ``"kv_stream": true``).

A prefill leg that asks for it (``{"do_remote_decode": true, "kv_stream": true}``) gets its
transfer id when it is admitted, not when it finishes: the connector announces the params at
once (the engine sends them ahead of any token, ``engine_api.KVTransferFrame``), so the decode
leg starts and its pull waits on the transfer port while the prefill's chunks are computed.
Its params carry ``"remote_streaming": true``; ``remote_num_blocks`` is the prompt's full blocks
before its last token (what a decode engine loads).

Lifecycle of one stream (all on the engine thread)::

    admitted          open()      a streamed transfer (``HeldTransfers.open_stream``), announced
    each step applied advance()   its blocks computed so far are ready to send (final KV: the
                                  step that filled them is applied, and a prompt block is
                                  never written again while its request runs)
    each schedule     ended()     preempted since it opened: the transfer is cancelled before
                                  any step can write its freed blocks (``cancel`` waits for a
                                  copy in progress); the stream never reopens (a recompute)
    finished          finish()    all computed: held until pulled, as a complete transfer;
                                  aborted before its prompt was computed: cancelled, freed

A decode engine that pulled part of a cancelled stream keeps what arrived (it was final) and
recomputes the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.engine.kv_connector.base import ConnectorRequest
from services.engine.kv_connector.pd_server import HeldTransfers

logger = logging.getLogger(__name__)

NO_TRANSFER = {"do_remote_prefill": False, "do_remote_decode": False}
# Grant(request id, transfer id, block count) -> the signed params
Grant = Callable[[str, str, int], dict[str, Any]]


def asks_stream(params: Any) -> bool:
    return isinstance(params, dict) and params.get("do_remote_decode") is True and \
        params.get("kv_stream") is True


@dataclass(slots=True)
class _Stream:
    request: ConnectorRequest
    transfer_id: str | None  # None: ended (preempted); never served again
    num_blocks: int  # the blocks the transfer covers: the prompt's full ones before its last token
    preemptions: int  # the request's count when it opened
    grant: dict[str, Any]
    ready: int = 0  # blocks handed to the transfer so far


class StreamedPrefills:
    def __init__(self, held: HeldTransfers, block_size: int, block_manager: Any) -> None:
        self.held, self.block_size, self.block_manager = held, block_size, block_manager
        self._streams: dict[str, _Stream] = {}
        self._announced: dict[str, dict[str, Any]] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request: ConnectorRequest, grant: Grant) -> None:
        """At admission (and again after a preemption: then nothing happens)."""
        rid = request.request_id
        if rid in self._streams:
            return
        n = min((len(request.prompt_token_ids) - 1) // self.block_size,
                len(request.block_hashes))
        if n <= 0:
            return  # nothing to stream: the leg answers when it finishes, as an unstreamed one
        tid = self.held.open_stream(rid, request.block_hashes[:n])
        if tid is None:
            return  # the table is full: the same at finish, where the decode leg recomputes
        params = {**grant(rid, tid, n), "remote_streaming": True}
        self._streams[rid] = _Stream(request, tid, n, request.num_preemptions, params)
        self._announced[rid] = params

    def take_announced(self) -> dict[str, dict[str, Any]]:
        announced, self._announced = self._announced, {}
        return announced

    def ended(self) -> None:
        """After each schedule, before its step runs: a preempted request's blocks went back to
        the pool and may be written by that step, so its transfer ends now."""
        for rid, s in self._streams.items():
            if s.transfer_id is not None and s.request.num_preemptions != s.preemptions:
                logger.info("request_id=%s: preempted while its KV streamed: the stream ends "
                            "after %d of %d blocks", rid, s.ready, s.num_blocks)
                self.held.cancel(s.transfer_id)
                s.transfer_id = None

    def advance(self) -> None:
        """After each step is applied: the blocks it completed are ready to send."""
        bs = self.block_size
        for rid, s in self._streams.items():
            if s.transfer_id is None:
                continue
            req = s.request
            ready = min(min(req.num_computed_tokens, len(req.prompt_token_ids)) // bs,
                        s.num_blocks)
            if ready > s.ready:
                s.ready = ready
                self.held.advance(s.transfer_id, self.block_manager.block_ids(rid)[:ready])

    def finish(self, request: ConnectorRequest,
               block_ids: list[int]) -> tuple[bool, dict[str, Any]] | None:
        """``request_finished`` for a streamed prefill (None: not one): whether its blocks
        are held, and its params."""
        s = self._streams.pop(request.request_id, None)
        if s is None:
            return None
        self._announced.pop(request.request_id, None)
        if s.transfer_id is None:
            return False, dict(NO_TRANSFER)
        computed = min(request.num_computed_tokens, len(request.prompt_token_ids))
        if computed // self.block_size < s.num_blocks:  # aborted mid-prompt: its blocks go
            self.held.cancel(s.transfer_id)
            return False, dict(NO_TRANSFER)
        return self.held.finish(s.transfer_id, block_ids[:s.num_blocks]), s.grant
