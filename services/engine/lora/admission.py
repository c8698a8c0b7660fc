"""The scheduler's adapter limit: at most ``max_loras`` distinct adapters run at a time.

Running requests hold their adapters (they keep their slots until they leave). Waiting ones
are admitted in arrival order (FCFS); one whose adapter is new and would exceed the limit is
*deferred*: it keeps its place in the queue while later requests that fit (the base model, or
an adapter already running) go ahead. So that a busy pair of adapters cannot keep a third
waiting forever, a request deferred for ``MAX_DEFERRED_STEPS`` steps *reserves*: from then
on no later request of another adapter is admitted until it is, so the running adapters drain
and it gets a slot (base-model requests still flow: they take none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Protocol

from services.protocol.block_hash import AdapterKey

MAX_DEFERRED_STEPS = 16


class _Adapter(Protocol):
    name: str
    key: AdapterKey


class Request(Protocol):
    """What admission reads and writes of a request (the engine's ``Request``)."""

    adapter: _Adapter | None
    adapter_deferred_steps: int


class AdapterAdmission:
    """One scheduling pass's view of the adapter limit (built per ``schedule``)."""

    __slots__ = ("active", "deferred", "max_loras", "reserved")

    def __init__(self, running: Iterable[Request], max_loras: int) -> None:
        self.max_loras = max_loras
        self.active: set[AdapterKey] = {r.adapter.key for r in running if r.adapter is not None}
        self.reserved: AdapterKey | None = None
        self.deferred: list[Request] = []

    def admits(self, req: Request) -> bool:
        """Whether ``req`` may be admitted now; if not, it is recorded as deferred."""
        if req.adapter is None:
            return True
        key = req.adapter.key
        fits = key in self.active or len(self.active) < self.max_loras
        if fits and (self.reserved is None or key == self.reserved):
            return True
        req.adapter_deferred_steps += 1
        if self.reserved is None and req.adapter_deferred_steps >= MAX_DEFERRED_STEPS:
            self.reserved = key
        self.deferred.append(req)
        return False

    def admitted(self, req: Request) -> None:
        if req.adapter is not None:
            self.active.add(req.adapter.key)
            req.adapter_deferred_steps = 0


def adapter_limit(max_loras: int) -> Callable[[Iterable[Request]], AdapterAdmission] | None:
    """The scheduler's ``admission`` for at most ``max_loras`` adapters (None: LoRA off)."""
    return functools.partial(AdapterAdmission, max_loras=max_loras) if max_loras > 0 else None
