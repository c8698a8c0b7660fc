"""The worker processes of a tensor-parallel engine: started by rank 0, watched until it ends.

Rank 0 (the engine process) starts ranks 1..N-1, each ``python -m <entry module>``: a fresh
interpreter (never a fork of a process that holds threads or a CUDA context) that imports only
the entry module, never the user's script (``worker_main``). Each reads its ``WorkerArgs``
from a pipe on its standard input, loads its shard, then runs each step it is sent until told
to stop. This package knows the entry only by name: the engine that uses it names its own.

Failure is never a hang:

* a worker that exits while the engine runs: a watchdog thread in the engine sees it (the
  process's pidfd), logs which rank and its exit code, kills the other workers and exits the
  engine process with status 1, at once, whatever rank 0 was doing (blocked in a collective
  with the dead rank, on NCCL, it would otherwise wait forever). The pod restarts.
* the engine process dying: the kernel kills every worker (``PR_SET_PDEATHSIG``, bound to the
  thread that started them: the engine's own thread), and any collective in progress on gloo
  fails at once.
* an error on rank 0 in the middle of a step (the ranks are then out of step): ``abort``.
* with ranks in other pods (a node group, ``node_group``): rank 0 admits them at its door
  (``node_join``) instead of starting them, and a worker node that dies or hangs is seen on
  its heartbeat link (``node_links``) within seconds, which ``abort`` too.

Lifecycle: ``close`` (a stop message, a grace period, then a kill) ends the workers and leaves
the process group, so that the process can start another tensor-parallel engine after it; it
is idempotent and also runs at interpreter exit, so that a normal exit is never read as the
workers' failure.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from services.engine.parallel import group as tp_group
from services.engine.parallel import node_join
from services.engine.parallel.node_group import NodeGroup
from services.engine.parallel.node_links import NodeLinks
from services.engine.parallel.step_broadcast import send_stop
from services.engine.parallel.worker_main import EXIT_CODE, WorkerArgs

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0
# The directory that holds the ``services`` package: on the workers' import path whatever
# the engine's working directory or ``sys.path`` tweaks.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device one rank runs on: its own GPU (``cuda:<base + rank>``), else the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (device.index or 0) + rank)


def check_devices(size: int, device: torch.device) -> None:
    """More ranks than GPUs is an error at start, naming both numbers."""
    if device.type != "cuda":
        return
    have = torch.cuda.device_count()
    first = device.index or 0
    if first + size > have:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, but "
            f"{have} {'is' if have == 1 else 'are'} visible"
        )


class WorkerGroup:
    """Ranks 1..N-1 of an engine, as seen from rank 0; ``tp`` is rank 0's group and ``device``
    its device.

    ``module``: the workers' entry (run as ``python -m module``; it calls
    ``worker_main.run_worker``); ``payload``: what that entry needs to build a rank's shard,
    the same for every rank (each learns its own rank and device from its ``WorkerArgs``).

    ``nodes``: the node group when the ranks span pods (one rank per pod for now: no local
    worker starts); ``identity``: what every worker node must match to be admitted."""

    def __init__(self, module: str, size: int, device: torch.device, payload: object,
                 nodes: NodeGroup | None = None,
                 identity: node_join.Identity | None = None) -> None:
        remote = nodes is not None and nodes.nnodes > 1
        assert not remote or size == nodes.nnodes, "one rank per pod (EngineConfig checks)"
        check_devices(1 if remote else size, device)
        tp_group.check_free()  # before any worker starts
        self.device = rank_device(device, 0)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._pidfds: dict[int, subprocess.Popen[bytes]] = {}
        self._closing = threading.Event()
        self._watchdog: threading.Thread | None = None
        self._links: NodeLinks | None = None
        self._store = tp_group.create_store(size)  # the rendezvous: kept for the group's life
        try:
            if remote:
                store = self._admit(nodes, identity or {})
            else:
                store = self._store
                self._start_local(module, size, device, payload)
            atexit.register(self.close)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            loopback = not remote or nodes.is_loopback()
            self.tp = tp_group.join(0, size, store, self.device, loopback)
        except BaseException:
            self.kill()
            raise

    def _start_local(self, module: str, size: int, device: torch.device,
                     payload: object) -> None:
        level = logging.getLogger().getEffectiveLevel()
        for rank in range(1, size):
            args = WorkerArgs(rank, size, self._store.port, os.getpid(),
                              str(rank_device(device, rank)), level, payload)
            self.procs.append(_start(module, args))
        # pidfds: readable once a worker exits (no polling, no race with close's wait)
        self._pidfds = {os.pidfd_open(p.pid): p for p in self.procs}
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def _admit(self, nodes: NodeGroup, identity: node_join.Identity) -> dist.Store:
        """Rank 0 of a node group: admits every worker node, watches them from then on;
        returns the store they were told of (under its secret prefix)."""
        prefix = node_join.new_prefix()
        logger.info("waiting for %d worker node(s) at %s:%d", nodes.nnodes - 1,
                    nodes.master_addr, nodes.master_port)
        links = node_join.Door(nodes).admit(identity, self._store.port, prefix,
                                            tp_group.COLLECTIVE_TIMEOUT.total_seconds())
        self._links = NodeLinks({f"worker node rank {r}": c for r, c in links.items()},
                                self.abort).start()
        return dist.PrefixStore(prefix, self._store)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        try:
            ended, _, _ = select.select(list(self._pidfds), [], [])
            if self._closing.is_set():
                return
            proc = self._pidfds[ended[0]]
            self.abort(f"tensor-parallel worker rank {self.procs.index(proc) + 1} (pid "
                       f"{proc.pid}) exited with code {proc.wait()}")
        finally:
            for fd in self._pidfds:
                os.close(fd)

    def abort(self, reason: str) -> None:
        """The engine cannot go on with a rank missing or out of step: end it now, non-zero."""
        logger.critical("%s; the engine exits (status %d)", reason, EXIT_CODE)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        logging.shutdown()
        os._exit(EXIT_CODE)

    def close(self) -> None:
        """Stops the workers (told, then killed after a grace period) and leaves the group."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            if all(p.poll() is None for p in self.procs):
                send_stop(self.tp)
        except RuntimeError:  # a worker died meanwhile: nothing left to tell
            logger.warning("could not tell the tensor-parallel workers to stop")
        if self._links is not None:
            self._links.close()
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop: killed", p.pid)
                p.kill()
                p.wait()
        self._end()

    def kill(self) -> None:
        """Ends the workers at once (rank 0 failed to start: no stop message can reach them)."""
        self._closing.set()
        if self._links is not None:
            self._links.close()
        for p in self.procs:
            p.kill()
            p.wait()
        self._end()

    def _end(self) -> None:
        if self._watchdog is not None:
            self._watchdog.join()  # every worker has exited: it returns at once
        tp_group.leave()
        atexit.unregister(self.close)


def _start(module: str, args: WorkerArgs) -> subprocess.Popen[bytes]:
    """``python -P -m module`` (``-P``: the working directory is not on its import path) with
    ``args`` on its standard input; stdout and stderr are the engine's."""
    path = os.pathsep.join(p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.Popen([sys.executable, "-P", "-m", module], stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path})
    with contextlib.suppress(BrokenPipeError), proc.stdin:  # broken: it died at start, and
        pickle.dump(args, proc.stdin)  # the watchdog reports its exit code
    logger.info("tensor-parallel worker rank=%d pid=%d started", args.rank, proc.pid)
    return proc
