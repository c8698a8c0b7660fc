"""The fixed device slots adapters run from, LRU-swapped (engine thread only).

``max_loras`` slots. A slot holds one adapter (by ``AdapterKey``) and counts the input-batch
rows using it; a joining row whose adapter is already in a slot just counts in. Otherwise it
takes a free slot, or the least recently used one no row uses, and the copy of the adapter's
weights into it is queued (``take_installs``): the runner hands it to the step thread, which
does it before the step that first reads the slot. A slot that no row uses keeps its adapter
(a later request for it costs no copy) until it is taken.

The scheduler admits at most ``max_loras`` distinct adapters among running requests, so a
joining row always finds a slot (an assertion otherwise).
"""

from __future__ import annotations

from collections import OrderedDict

from services.engine.lora.peft import AdapterWeights
from services.protocol.block_hash import AdapterKey


class DeviceSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owner: list[AdapterKey | None] = [None] * num_slots
        self.users = [0] * num_slots
        self._by_key: dict[AdapterKey, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._installs: list[tuple[int, AdapterWeights]] = []

    def acquire(self, adapter: AdapterWeights) -> int:
        """The slot a joining row of ``adapter`` reads (installing it if needed)."""
        key = adapter.key
        slot = self._by_key.get(key)
        if slot is None:
            slot = self._evict()
            self.owner[slot] = key
            self._by_key[key] = slot
            self._installs.append((slot, adapter))
        if self.users[slot] == 0:
            self._idle.pop(slot, None)
        self.users[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        assert self.users[slot] > 0, slot
        self.users[slot] -= 1
        if self.users[slot] == 0:
            self._idle[slot] = None  # most recently used last

    def take_installs(self) -> list[tuple[int, AdapterWeights]]:
        out, self._installs = self._installs, []
        return out

    def forget(self, key: AdapterKey) -> None:
        """An unloaded adapter's idle slot becomes free (one in use keeps serving its rows)."""
        slot = self._by_key.get(key)
        if slot is not None and self.users[slot] == 0:
            del self._by_key[key]
            self.owner[slot] = None
            self._idle.move_to_end(slot, last=False)

    def resident(self) -> list[AdapterKey]:
        return [k for k in self.owner if k is not None]

    def _evict(self) -> int:
        assert self._idle, "more distinct adapters running than slots (the scheduler's limit)"
        slot = next(iter(self._idle))  # free slots first (moved to the front), then the LRU
        del self._idle[slot]
        old = self.owner[slot]
        if old is not None:
            del self._by_key[old]
        return slot
