"""The engine's adapters: which names it knows, their weights in host memory, their slots.

``LoRAManager`` lives on the engine thread (the ``LLMEngine``'s runner owns it, rank 0 only).
A name is *registered* with its path and origin (``--lora-modules``, the offline API, a
runtime load); its weights are kept in a host-memory LRU of ``max_cpu_loras`` adapters
(requests hold their own reference, so evicting one in use frees nothing until they end; an
evicted adapter is read again from its path when a request needs it, and gets the new digest
if its files changed). Slots are ``slots.DeviceSlots``.

``read`` touches only immutable state (the targets, the limits) and may run on any thread:
runtime loads read on the loader thread (``commands``) and ``register`` the result on the
engine thread; ``load`` does both at once (``--lora-modules``, the offline API, and the
re-read of an adapter evicted from host memory).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from services.engine.lora.admission import Request
from services.engine.lora.paths import AdapterSource
from services.engine.lora.peft import AdapterWeights, max_file_size, read_adapter
from services.engine.lora.request import LoRARequest
from services.engine.lora.slots import DeviceSlots
from services.engine.lora.targets import LoRATargets
from services.protocol.lora_api import IN_HOST, IN_SLOT, ON_DISK
from services.protocol.wire import BadRequest

logger = logging.getLogger(__name__)

# Where a registered adapter came from.
STATIC = "static"  # --lora-modules
OFFLINE = "offline"  # LLM.generate(lora_request=...)
RUNTIME = "runtime"  # the server's load API (or the registry in Redis)



@dataclass(slots=True)
class Registered:
    name: str
    path: str  # as given
    origin: str
    int_id: int | None
    version: str  # of the weights last read
    source: AdapterSource  # where its files are (read again from there after an eviction)


@dataclass(frozen=True, slots=True)
class AdapterState:
    """One adapter as the server reports it (heartbeats, /v1/models, metrics)."""

    name: str
    path: str
    version: str
    residency: int  # IN_SLOT, IN_HOST or ON_DISK
    origin: str


@dataclass(frozen=True, slots=True)
class LoRAStats:
    """The adapters' part of the engine's stats (``vllm:lora_requests_info``, heartbeats)."""

    max_loras: int
    running: tuple[str, ...]  # adapters of running requests, sorted
    waiting: tuple[str, ...]  # adapters of waiting requests, sorted
    adapters: tuple[AdapterState, ...]


class LoRAManager:
    def __init__(self, targets: LoRATargets, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, max_file_bytes: int | None = None) -> None:
        self.targets = targets
        self.max_rank = max_rank
        self.max_file_bytes = max_file_bytes or max_file_size(targets, max_rank)
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.slots = DeviceSlots(max_loras)
        self.registered: dict[str, Registered] = {}
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()

    # -- registering ------------------------------------------------------------------------

    def read(self, name: str, source: AdapterSource) -> AdapterWeights:
        """Reads and validates an adapter (any thread). Raises ``BadRequest`` naming the field
        or module."""
        return read_adapter(name, source, self.targets, self.max_rank, self.dtype,
                            self.max_file_bytes)

    def load(self, name: str, path: str, origin: str, int_id: int | None = None,
             source: AdapterSource | None = None) -> AdapterWeights:
        """Reads, validates and registers ``name`` (replacing what the name held); ``source``:
        where ``path`` resolved to (a runtime load's, inside the roots). Raises
        ``BadRequest`` naming the field or module; nothing changes then."""
        weights = self.read(name, source or AdapterSource.of(path))
        return self.register(weights, origin, source or AdapterSource.of(path), int_id)

    def register(self, weights: AdapterWeights, origin: str, source: AdapterSource,
                 int_id: int | None = None) -> AdapterWeights:
        """Registers weights ``read`` (the engine thread)."""
        name = weights.name
        weights.int_id = int_id
        previous = self._host.get(name)
        if previous is not None and previous.version != weights.version:
            self.slots.forget(previous.key)  # its idle slot must not be found by a new request
        self.registered[name] = Registered(name, weights.path, origin, int_id,
                                           weights.version, source)
        self._cache(weights)
        logger.info("adapter loaded name=%s version=%s rank=%d origin=%s bytes=%d", name,
                    weights.version, weights.rank, origin, weights.nbytes)
        return weights

    def unload(self, name: str) -> bool:
        """Forgets ``name``; requests running under it finish with the weights they hold."""
        entry = self.registered.pop(name, None)
        if entry is None:
            return False
        weights = self._host.pop(name, None)
        if weights is not None:
            self.slots.forget(weights.key)
        logger.info("adapter unloaded name=%s", name)
        return True

    # -- requests ---------------------------------------------------------------------------

    def resolve(self, lora: LoRARequest | str) -> AdapterWeights:
        """The weights a request runs under: a registered name, or an offline
        ``LoRARequest`` (registered on first use; a new path under its name replaces it)."""
        if isinstance(lora, LoRARequest):
            entry = self.registered.get(lora.lora_name)
            if entry is None or entry.path != lora.lora_path:
                return self.load(lora.lora_name, lora.lora_path, OFFLINE, lora.lora_int_id)
            name = lora.lora_name
        else:
            name = lora
            entry = self.registered.get(name)
            if entry is None:
                raise BadRequest(f"the adapter {name!r} is not loaded", "lora_name")
        weights = self._host.get(name)
        if weights is not None:
            self._host.move_to_end(name)
            return weights
        # Evicted from host memory: read it again (a changed file gets a new version).
        return self.load(name, entry.path, entry.origin, entry.int_id, entry.source)

    def _cache(self, weights: AdapterWeights) -> None:
        self._host[weights.name] = weights
        self._host.move_to_end(weights.name)
        while len(self._host) > self.max_cpu_loras:
            evicted, _ = self._host.popitem(last=False)
            logger.debug("adapter evicted from host memory name=%s", evicted)

    # -- reporting --------------------------------------------------------------------------

    def stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> LoRAStats:
        def names(requests: Iterable[Request]) -> tuple[str, ...]:
            return tuple(sorted({r.adapter.name for r in requests if r.adapter is not None}))

        return LoRAStats(self.slots.num_slots, names(running), names(waiting),
                         tuple(self.states()))

    def states(self) -> list[AdapterState]:
        in_slot = set(self.slots.resident())
        out = []
        for name, entry in self.registered.items():
            weights = self._host.get(name)
            if weights is None:
                residency = ON_DISK
            elif weights.key in in_slot:
                residency = IN_SLOT
            else:
                residency = IN_HOST
            out.append(AdapterState(name, entry.path, entry.version, residency, entry.origin))
        return out
