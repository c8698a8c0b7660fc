"""A rank's view of its tensor-parallel group, and how the groups are set up.

Two groups over the same ranks: ``group`` carries the model's collectives (NCCL on GPUs, gloo
on the CPU) and ``step_group`` (always gloo, on the host) the per-step batch and the start-up
agreements. The step group's timeout is effectively infinite: a worker waits on it for the
next step however long the engine stays idle; a dead peer still ends the wait at once (its
sockets close), and the engine's watchdog (``workers``) covers the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Model collectives: long enough for the slowest rank to load a large checkpoint.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
_IDLE_TIMEOUT = timedelta(days=3650)
_HOST = "127.0.0.1"  # all ranks live in one pod (else: ``node_group``)


@dataclass(frozen=True, slots=True)
class TPGroup:
    """This rank's place in the tensor-parallel group; ``SINGLE`` when there is none."""

    rank: int = 0
    size: int = 1
    group: Any = None  # ProcessGroup of the model's collectives
    step_group: Any = None  # gloo ProcessGroup of the step broadcast

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape on all), on rank 0 only; None elsewhere."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        dist.gather(x, parts, dst=0, group=self.group)
        return parts

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (KV blocks: every rank must fit the pool)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.step_group)
        return int(t.item())


SINGLE = TPGroup()

# The group the parallel layers being built belong to: set around model construction only
# (``building``); each layer keeps the group it was built with, so nothing reads this later.
_BUILDING: contextvars.ContextVar[TPGroup] = contextvars.ContextVar("tp_building", default=SINGLE)


@contextlib.contextmanager
def building(tp: TPGroup) -> Iterator[None]:
    token = _BUILDING.set(tp)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def current() -> TPGroup:
    """The group of the model under construction (``SINGLE`` outside ``building``)."""
    return _BUILDING.get()


def create_store(size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store, on a free port (``store.port``)."""
    return dist.TCPStore(_HOST, 0, size, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)


def check_free() -> None:
    """One tensor-parallel engine at a time per process: the next after ``leave``."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already runs a tensor-parallel engine (one at a time per process: "
            "shut the other down first, e.g. LLM.shutdown())"
        )


def join(rank: int, size: int, store: dist.Store, device: torch.device,
         loopback: bool = True) -> TPGroup:
    """Joins the group as ``rank`` (every rank calls this; it returns once all have).
    ``loopback``: every rank is on this host (one pod, or a node group on one machine)."""
    check_free()
    # One host: gloo talks over loopback unless the operator said otherwise. Across pods gloo
    # takes the interface of this host's name (the pod's IP), or $GLOO_SOCKET_IFNAME.
    if loopback:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    step_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD, step_group)


def connect_store(port: int, size: int, host: str = _HOST) -> dist.TCPStore:
    return dist.TCPStore(host, port, size, False, timeout=COLLECTIVE_TIMEOUT)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where a rank finds rank 0's store, and how it joins the group through it."""

    port: int  # rank 0's store
    host: str = _HOST  # the leader's address in a node group; this host in one pod
    prefix: str = ""  # a node group's secret key prefix (``node_join``); "" in one pod
    loopback: bool = True  # every rank of the group on this host (``join``)

    def wrap(self, store: dist.Store) -> dist.Store:
        """``store`` under this group's key prefix (rank 0 wraps the store it created)."""
        return dist.PrefixStore(self.prefix, store) if self.prefix else store

    def connect(self, size: int) -> dist.Store:
        """A rank other than 0: the store, under the prefix."""
        return self.wrap(connect_store(self.port, size, self.host))


def leave() -> None:
    """Destroys this process's groups (both), if it is in one."""
    if dist.is_initialized():
        dist.destroy_process_group()
