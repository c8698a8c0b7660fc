"""Counters of KV transfers between engines, on both ends (the puller and the server), read by
the engine's ``/metrics`` (``pagoda:kv_transfer_*`` and vLLM's NIXL connector's names).

Pull threads and the transfer server's threads record into one ``TransferStats`` under its
lock; the engine's stats snapshot copies it (``snapshot``), so a scrape never reads a
half-written histogram.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

# Seconds: from a loopback block run (milliseconds) to a long prompt over a slow link.
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Bytes per transfer: 2 KiB .. 8 GiB by factors of 4 (vLLM's NIXL connector's shape).
BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
DIRECTIONS = ("received", "sent")


@dataclass(slots=True)
class Histogram:
    """Cumulative-ready counts: ``counts[i]`` observations <= ``buckets[i]``, the last one
    for +Inf."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.total)


@dataclass(slots=True)
class DirectionStats:
    bytes: int = 0
    transfers: int = 0
    seconds: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    sizes: Histogram = field(default_factory=lambda: Histogram(BYTES_BUCKETS))

    def copy(self) -> DirectionStats:
        return DirectionStats(self.bytes, self.transfers, self.seconds.copy(), self.sizes.copy())


@dataclass(slots=True)
class TransferStats:
    received: DirectionStats = field(default_factory=DirectionStats)
    sent: DirectionStats = field(default_factory=DirectionStats)
    failures: dict[str, int] = field(default_factory=dict)  # reason -> count (both ends)
    expired: int = 0  # held transfers never pulled (vllm:nixl_num_kv_expired_reqs)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def done(self, direction: str, nbytes: int, seconds: float) -> None:
        """A transfer (or the part of one that arrived) of ``nbytes`` took ``seconds``."""
        assert direction in DIRECTIONS
        with self._lock:
            d = self.received if direction == "received" else self.sent
            d.bytes += nbytes
            d.transfers += 1
            d.seconds.observe(seconds)
            d.sizes.observe(float(nbytes))

    def failed(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1

    def add_expired(self, count: int) -> None:
        with self._lock:
            self.expired += count

    def snapshot(self) -> TransferStats:
        with self._lock:
            return TransferStats(self.received.copy(), self.sent.copy(), dict(self.failures),
                                 self.expired)

    def __getstate__(self) -> tuple:  # crosses to the server process without its lock
        return (self.received, self.sent, self.failures, self.expired)

    def __setstate__(self, state: tuple) -> None:
        self.received, self.sent, self.failures, self.expired = state
        self._lock = threading.Lock()
