"""The KV events between the engine core and the Redis publisher: bounded, never lossy in silence.

The core queues every step's events here (on the event loop); the publisher takes them on its
ticks. While Redis is unreachable they pile up. Past ``max_events`` the queue is dropped whole
and the core is asked to re-announce its prefix cache (``Resync``: "cleared", then every cached
hash, two events whatever the cache's size). That is correct because the core answers commands
in order: the snapshot reaches this queue after every event that was dropped, and it says all
they would have said. It is also cheaper than a long replay, which the index would only have to
catch up through.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from services.protocol.kv_events import KVEvent

logger = logging.getLogger(__name__)

# A busy GPU engine makes about a thousand events a second (one per block filled or evicted,
# runs of blocks in one), a few hundred bytes each; the publisher sends up to 50,000 a tick.
# So this holds a minute or two of a Redis outage in tens of MB, past which a snapshot is the
# shorter way back anyway.
MAX_QUEUED_KV_EVENTS = 100_000


class KVEventQueue:
    """FIFO of KV events; overflow empties it and calls ``resync`` (the core re-announces)."""

    def __init__(self, resync: Callable[[], None], max_events: int = MAX_QUEUED_KV_EVENTS) -> None:
        if not max_events >= 1:
            raise ValueError(f"max_events must be >= 1, got {max_events!r}")
        self.max_events = max_events
        self.num_overflows = 0
        self._resync = resync
        self._events: deque[KVEvent] = deque()
        self._overflowing = False  # warned since the publisher last caught up: warn once

    def __len__(self) -> int:
        return len(self._events)

    def extend(self, events: Iterable[KVEvent]) -> None:
        self._events.extend(events)
        if len(self._events) > self.max_events:
            self._overflow()

    def take(self, n: int) -> list[KVEvent]:
        """Up to ``n`` of the oldest events, removed."""
        q = self._events
        taken = [q.popleft() for _ in range(min(n, len(q)))]
        if not q:
            self._overflowing = False  # caught up: a later overflow is news again
        return taken

    def _overflow(self) -> None:
        self.num_overflows += 1
        dropped = len(self._events)
        self._events.clear()
        if not self._overflowing:
            logger.warning(
                "KV event queue over %d events (is Redis reachable?): dropped %d and asked the "
                "core to re-announce its prefix cache", self.max_events, dropped)
        else:
            logger.debug("KV event queue overflowed again: dropped %d, resync asked", dropped)
        self._overflowing = True
        self._resync()
