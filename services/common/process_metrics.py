"""Process-level gauges every service exports: open asyncio tasks and resident memory.

A steady ``pagoda_event_loop_tasks`` under constant load, and an RSS that stops growing, are
how a soak shows nothing leaks (tasks left behind by cancelled streams, buffers never freed).
The collector runs inside the ``/metrics`` handler, so it sees that handler's event loop.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_PAGE = resource.getpagesize()


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):  # not Linux
        return None


class ProcessCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            yield GaugeMetricFamily(
                "pagoda_event_loop_tasks",
                "asyncio tasks alive in the service's event loop.",
                value=len(asyncio.all_tasks(loop)),
            )
        rss = _rss_bytes()
        if rss is not None:
            yield GaugeMetricFamily(
                "pagoda_process_resident_memory_bytes", "Resident memory of the process.",
                value=rss,
            )


def register_process_metrics(registry: CollectorRegistry) -> None:
    registry.register(ProcessCollector())
