"""Blocks of this engine's prefix cache served to a peer by chain hash (a prefix pulled from a
peer: the router named this engine as one that holds more of a prompt's prefix).

The block manager belongs to the engine thread, so a transfer thread never touches it: it
posts the hashes it was asked for (``pin``) and waits; the engine thread, between steps (in the
connector's ``save_kv``, when every cached block holds final KV, or while idle), holds the
leading run of those hashes the cache has (``serve``) and hands back their ids; the transfer
thread copies them out and posts them back (``unpin``), and the engine thread releases them at
its next call. A pin the transfer thread gave up on before it was served is never held.

A hash is the block-hash chain's: it covers every token before it, the tenant's salt and the
adapter, so a peer asking with its own request's chain gets that tenant's blocks or none.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from services.protocol.block_hash import BlockHash


@dataclass(slots=True)
class _Pin:
    hashes: list[BlockHash]
    done: threading.Event = field(default_factory=threading.Event)
    block_ids: list[int] = field(default_factory=list)
    cancelled: bool = False


class PeerBlocks:
    def __init__(self, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        self._lock = threading.Lock()
        self._pins: deque[_Pin] = deque()
        self._unpins: list[list[int]] = []
        self.held = 0  # blocks held for peers right now (tests: back to 0)

    # -- transfer threads --------------------------------------------------------------------

    def pin(self, hashes: list[BlockHash], timeout: float) -> list[int] | None:
        """The ids of the leading run of ``hashes`` in the cache, held until ``unpin``; None
        when the engine did not answer in ``timeout`` s (or too many wait already)."""
        pin = _Pin(hashes)
        with self._lock:
            if len(self._pins) >= self.max_pending:
                return None
            self._pins.append(pin)
        if pin.done.wait(timeout):
            return pin.block_ids
        with self._lock:
            if not pin.done.is_set():
                pin.cancelled = True
                return None
        return pin.block_ids  # served while we gave up: still ours to unpin

    def unpin(self, block_ids: list[int]) -> None:
        if block_ids:
            with self._lock:
                self._unpins.append(block_ids)

    # -- the engine thread ---------------------------------------------------------------------

    def serve(self, block_manager: Any) -> None:
        """Releases what peers finished reading, holds what they ask for."""
        with self._lock:
            unpins, self._unpins = self._unpins, []
            pins = [p for p in self._pins if not p.cancelled]
            self._pins.clear()
            for ids in unpins:
                block_manager.release(ids)
                self.held -= len(ids)
            for pin in pins:
                pin.block_ids = block_manager.hold_cached(pin.hashes)
                self.held += len(pin.block_ids)
                pin.done.set()
