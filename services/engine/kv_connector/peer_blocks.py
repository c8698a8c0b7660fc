"""Blocks of this engine's prefix cache served to a peer by chain hash (a prefix pulled from a
peer: the router named this engine as one that holds more of a prompt's prefix).

The block manager and the host tier belong to the engine thread, so a transfer thread never
touches them: it posts the hashes it was asked for (``pin``) and waits; the engine thread,
between steps (in the connector's ``save_kv``, when every cached block holds final KV, or while
idle), holds the leading run of those hashes this engine has (``serve``) and hands back where
each block is: the pool (held as a copy holds it) or, when the pool evicted it, the host tier
(its slot pinned, so it is neither evicted nor reused). The transfer thread copies them out
and posts them back (``unpin``), and the engine thread releases them at its next call. A pin
the transfer thread gave up on before it was served is never held.

A block on the host tier is sent from there as it is, never loaded into the pool first: the
pull costs the peer's pool nothing and its host memory nothing beyond the pinned slots, which
one ask bounds (``pd_server.MAX_PEER_BLOCKS``) as it bounds the held pool blocks.

A hash is the block-hash chain's: it covers every token before it, the tenant's salt and the
adapter, so a peer asking with its own request's chain gets that tenant's blocks or none.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.engine.kv_connector.pd_wire import read_block
from services.protocol.block_hash import BlockHash


class HostTier(Protocol):
    """What peers are lent of the KV tiers' host store (``HostBlockStore``)."""

    def lend(self, block_hash: BlockHash) -> int | None: ...
    def unpin(self, block_hash: BlockHash) -> None: ...
    def read(self, slot: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class Lent:
    """One block lent to a peer: a pool block (held) or a host-tier slot (pinned)."""

    block_hash: BlockHash
    pool_id: int | None  # None: on the host tier, at ``host_slot``
    host_slot: int | None = None


@dataclass(slots=True)
class _Pin:
    hashes: list[BlockHash]
    done: threading.Event = field(default_factory=threading.Event)
    lent: list[Lent] = field(default_factory=list)
    cancelled: bool = False


class PeerBlocks:
    def __init__(self, max_pending: int = 64) -> None:
        self.max_pending = max_pending
        # The KV tiers' host store, when the engine has one (``registry.build`` links it).
        self.host: HostTier | None = None
        self._lock = threading.Lock()
        self._pins: deque[_Pin] = deque()
        self._unpins: list[list[Lent]] = []
        self.held = 0  # blocks lent to peers right now, pool and host (tests: back to 0)

    # -- transfer threads --------------------------------------------------------------------

    def pin(self, hashes: list[BlockHash], timeout: float) -> list[Lent] | None:
        """The leading run of ``hashes`` this engine holds, held until ``unpin``; None when
        the engine did not answer in ``timeout`` s (or too many wait already)."""
        pin = _Pin(hashes)
        with self._lock:
            if len(self._pins) >= self.max_pending:
                return None
            self._pins.append(pin)
        if pin.done.wait(timeout):
            return pin.lent
        with self._lock:
            if not pin.done.is_set():
                pin.cancelled = True
                return None
        return pin.lent  # served while we gave up: still ours to unpin

    def unpin(self, lent: list[Lent]) -> None:
        if lent:
            with self._lock:
                self._unpins.append(lent)

    # -- the engine thread ---------------------------------------------------------------------

    def serve(self, block_manager: Any) -> None:
        """Releases what peers finished reading, holds what they ask for."""
        with self._lock:
            unpins, self._unpins = self._unpins, []
            pins = [p for p in self._pins if not p.cancelled]
            self._pins.clear()
            for lent in unpins:
                self._release(block_manager, lent)
            for pin in pins:
                pin.lent = self._lend(block_manager, pin.hashes)
                self.held += len(pin.lent)
                pin.done.set()

    def _lend(self, block_manager: Any, hashes: list[BlockHash]) -> list[Lent]:
        """Each block from the pool where it is cached, else from the host tier, up to the
        first block neither holds."""
        lent = []
        for h in hashes:
            pool = block_manager.hold_cached([h])
            if pool:
                lent.append(Lent(h, pool[0]))
                continue
            slot = None if self.host is None else self.host.lend(h)
            if slot is None:
                break
            lent.append(Lent(h, None, slot))
        return lent

    def read(self, kv_caches: list[tuple[Any, Any]], lent: list[Lent]) -> list[bytes]:
        """The lent blocks' bytes (the transfer thread, while they are lent)."""
        return [
            read_block(kv_caches, b.pool_id)
            if b.pool_id is not None
            else self.host.read(b.host_slot)
            for b in lent
        ]

    def _release(self, block_manager: Any, lent: list[Lent]) -> None:
        block_manager.release([b.pool_id for b in lent if b.pool_id is not None])
        for b in lent:
            if b.pool_id is None:
                assert self.host is not None
                self.host.unpin(b.block_hash)
        self.held -= len(lent)
