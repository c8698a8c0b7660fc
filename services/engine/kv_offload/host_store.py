"""Tier 1: KV blocks in host memory, keyed by chain hash, with LRU eviction of their own.

The bytes live in one preallocated tensor of ``num_slots`` blocks (pinned on CUDA, for
asynchronous copies); this class holds only the bookkeeping, and only the engine thread calls
it. The copy thread reads and writes slots it was handed, and a slot handed to it is pinned
(``pins`` > 0) until the engine thread hears that the copy is done, so it is never evicted or
reused under a copy.

An entry is ``ready`` once its bytes were written: only ready entries are hits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.protocol.block_hash import BlockHash
from services.protocol.kv_events import KVEvent, KVEventKind, Medium


@dataclass(slots=True)
class _Entry:
    slot: int
    token_ids: tuple[int, ...]
    ready: bool = False
    pins: int = 0


class HostBlockStore:
    """``num_slots`` host blocks of ``block_shape`` (layers, 2, block_size, kv_heads,
    head_dim)."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 block_size: int, pin_memory: bool = False, record_events: bool = False) -> None:
        assert num_slots > 0, num_slots
        self.block_size = block_size
        self.data = torch.empty((num_slots, *block_shape), dtype=dtype, pin_memory=pin_memory)
        self._entries: OrderedDict[BlockHash, _Entry] = OrderedDict()  # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self.record_events = record_events
        self._events: list[KVEvent] = []
        self.num_evictions = 0

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    @property
    def num_ready(self) -> int:
        return sum(1 for e in self._entries.values() if e.ready)

    def hits(self, hashes: Sequence[BlockHash], token_ids: Sequence[int], first: int,
             stop: int) -> list[int]:
        """Slots of the ready blocks ``first``, ``first + 1``, ... of a prompt (its hashes and
        tokens), up to block ``stop``, until the first miss; touched (most recently used)."""
        bs = self.block_size
        slots = []
        for i in range(first, stop):
            entry = self._entries.get(hashes[i])
            if entry is None or not entry.ready or (
                    entry.token_ids != tuple(token_ids[i * bs:(i + 1) * bs])):
                break
            self._entries.move_to_end(hashes[i])
            slots.append(entry.slot)
        return slots

    def pin(self, block_hash: BlockHash) -> None:
        self._entries[block_hash].pins += 1

    def lend(self, block_hash: BlockHash) -> int | None:
        """The slot of a ready block, pinned (``unpin`` when read) and touched, for a peer
        that asked by chain hash (the hash covers the tokens: no token check here, as in the
        pool's ``hold_cached``); None when it is not here."""
        entry = self._entries.get(block_hash)
        if entry is None or not entry.ready:
            return None
        self._entries.move_to_end(block_hash)
        entry.pins += 1
        return entry.slot

    def read(self, slot: int) -> bytes:
        """A slot's bytes in the pool's block order (per layer: key, then value). Any thread
        may call it for a slot pinned for it: the slot is neither evicted nor rewritten."""
        return self.data[slot].view(torch.uint8).numpy().tobytes()

    def unpin(self, block_hash: BlockHash) -> None:
        entry = self._entries[block_hash]
        entry.pins -= 1
        assert entry.pins >= 0, block_hash

    def reserve(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """A slot for a block about to be written (pinned, not ready), evicting the least
        recently used unpinned block if none is free; None when the block is already here
        (touched instead) or every slot is pinned."""
        entry = self._entries.get(block_hash)
        if entry is not None:
            self._entries.move_to_end(block_hash)
            return None
        slot = self._free.pop() if self._free else self._evict_one()
        if slot is None:
            return None
        self._entries[block_hash] = _Entry(slot, token_ids, ready=False, pins=1)
        return slot

    def written(self, hashes: Sequence[BlockHash], parent: BlockHash | None) -> None:
        """The copy thread wrote these reserved blocks: ready and unpinned (one event)."""
        for h in hashes:
            entry = self._entries[h]
            entry.ready = True
            entry.pins -= 1
        if self.record_events and hashes:
            self._events.append(KVEvent(KVEventKind.STORED, tuple(hashes), self.block_size,
                                        parent_hash=parent, medium=Medium.CPU))

    def discard(self, hashes: Sequence[BlockHash]) -> None:
        """Forgets reserved blocks whose copy failed (their slots are free again)."""
        for h in hashes:
            entry = self._entries.pop(h)
            assert not entry.ready, h
            self._free.append(entry.slot)

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def snapshot_events(self) -> list[KVEvent]:
        ready = tuple(h for h, e in self._entries.items() if e.ready)
        if not ready:
            return []
        return [KVEvent(KVEventKind.STORED, ready, self.block_size, medium=Medium.CPU)]

    def _evict_one(self) -> int | None:
        for h, entry in self._entries.items():  # least recently used first
            if entry.pins == 0:
                del self._entries[h]
                self.num_evictions += 1
                if self.record_events and entry.ready:
                    self._events.append(KVEvent(KVEventKind.REMOVED, (h,), self.block_size,
                                                medium=Medium.CPU))
                return entry.slot
        return None
