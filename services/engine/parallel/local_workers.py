"""The ranks one process starts on its own host, and watches until they stop.

A tensor-parallel engine's rank 0 starts ranks 1..N-1 (``workers``); in a node group each pod's
process starts the other ranks of its pod the same way (``worker_main.run_node_worker``). Each
is ``python -m <entry module>``: a fresh interpreter (never a fork of a process that holds
threads or a CUDA context) that imports only the entry module, never the user's script
(``worker_main``). It reads its ``WorkerArgs`` from a pipe on its standard input, joins the
group at its ``Rendezvous``, loads its shard, then runs each step until told to stop.

Watching: a pidfd per worker, readable once it exits (no polling, no race with ``close``'s
wait). A worker that exits non-zero, or by a signal, while the group runs is reported once to
``on_exit`` (the starter's end: the engine's ``abort``, a worker pod's exit), from the watch
thread, whatever the starter's step thread is blocked in. A worker exits 0 only after the
group's stop (``worker_main.run_worker``), so such an exit is not a failure: a worker pod reads
the stop in the same broadcast as its local workers, and one of them may be gone before the
pod's own process calls ``close``.

A worker that hangs (SIGSTOP, stuck) has no exit to see: each also has a heartbeat link to
its starter (``heartbeat``, a socket pair), pinged from a thread of its own whatever its step
thread is doing; 2.5 s of silence, or the link closing while the worker runs, is reported to
``on_exit`` as its death would be. A link that closes because the worker died defers to the
pidfd, which tells the exit code.

The workers die with the thread that started them (``PR_SET_PDEATHSIG``, armed in
``worker_main``): the starter's death ends them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.engine.parallel.group import Rendezvous
from services.engine.parallel.heartbeat import Heartbeats

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
# How long a worker whose link closed may take to become an exit the pidfd tells (its kernel
# closes its sockets just before it exits).
_DEATH_SETTLE_S = 0.3
# The directory that holds the ``services`` package: on the workers' import path whatever
# the engine's working directory or ``sys.path`` tweaks.
_SOURCE_ROOT = str(Path(__file__).resolve().parents[3])


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What the starting process hands a worker on its standard input."""

    rank: int  # global rank in the group
    size: int  # every rank of the group
    rendezvous: Rendezvous  # rank 0's store, and how to join through it
    parent_pid: int  # the process that started it (0: a worker pod's own process)
    device: str  # this rank's device
    log_level: int
    payload: Any  # what the entry module's ``build`` needs (the engine's config, model path)
    heartbeat_fd: int = -1  # its end of the heartbeat link to its starter (-1: none)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the pod's ``local_rank``-th rank: its own GPU (``cuda:<base + local>``),
    else the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", (device.index or 0) + local_rank)


def check_devices(size: int, device: torch.device) -> None:
    """More ranks in a pod than GPUs is an error at start, naming both numbers."""
    if device.type != "cuda":
        return
    have = torch.cuda.device_count()
    first = device.index or 0
    if first + size > have:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} GPUs from cuda:{first}, but "
            f"{have} {'is' if have == 1 else 'are'} visible"
        )


class LocalWorkers:
    """Ranks ``first_rank + 1 .. first_rank + count - 1`` of a group of ``size``, started on
    this host by the process that is ``first_rank`` (none when ``count`` is 1); ``device`` is
    that process's device (local rank 0)."""

    def __init__(self, module: str, first_rank: int, count: int, size: int,
                 device: torch.device, rendezvous: Rendezvous, payload: object,
                 on_exit: Callable[[str], None]) -> None:
        assert count >= 1 and first_rank + count <= size, (first_rank, count, size)
        check_devices(count, device)  # before any starts
        self.first_rank = first_rank
        self._on_exit = on_exit
        self._closing = threading.Event()
        level = logging.getLogger().getEffectiveLevel()
        self.procs: list[subprocess.Popen[bytes]] = []
        links: dict[str, socket.socket] = {}
        for local in range(1, count):
            ours, theirs = socket.socketpair()
            args = WorkerArgs(first_rank + local, size, rendezvous, os.getpid(),
                              str(rank_device(device, local)), level, payload, theirs.fileno())
            with theirs:  # the worker holds its own copy
                proc = _start(module, args)
            self.procs.append(proc)
            links[f"tensor-parallel worker rank {args.rank} (pid {proc.pid})"] = ours
        self._pidfds = {os.pidfd_open(p.pid): p for p in self.procs}
        self._watch_thread = threading.Thread(target=self._watch, name="tp-watchdog",
                                              daemon=True)
        self._watch_thread.start()
        self._heartbeats = Heartbeats(links, self._link_lost, from_first_ping=True,
                                     name="tp-heartbeats").start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_alive(self) -> bool:
        return all(p.poll() is None for p in self.procs)

    def _rank(self, proc: subprocess.Popen[bytes]) -> int:
        return self.first_rank + 1 + self.procs.index(proc)

    def _watch(self) -> None:
        watched = dict(self._pidfds)
        try:
            while watched:
                ended, _, _ = select.select(list(watched), [], [])
                if self._closing.is_set():
                    return
                proc = watched.pop(ended[0])
                code = proc.wait()
                if code != 0:  # 0: it stopped as told (the group's stop); watch the rest
                    self._on_exit(f"tensor-parallel worker rank {self._rank(proc)} (pid "
                                  f"{proc.pid}) exited with code {code}")
                    return
        finally:
            for fd in self._pidfds:
                os.close(fd)

    def _link_lost(self, why: str) -> None:
        """A worker's link closed or went silent: a hang is reported here; a death (some
        worker exits within ``_DEATH_SETTLE_S``) is the pidfd watch's to report, with its
        exit code, or not at all if it stopped cleanly."""
        deadline = time.monotonic() + _DEATH_SETTLE_S
        while time.monotonic() < deadline:
            if self._closing.is_set() or not self.all_alive():
                return
            time.sleep(0.05)
        self._on_exit(why)

    def stopping(self) -> None:
        """The starter is about to stop the group: an exit from now on is no failure."""
        self._closing.set()

    def kill_now(self) -> None:
        """Kills every worker still running, without waiting (the starter is about to exit)."""
        self._closing.set()
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def close(self, grace_s: float = STOP_GRACE_S) -> None:
        """Waits ``grace_s`` for the workers to stop (they were told), then kills the rest."""
        self._closing.set()
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel worker pid %d did not stop: killed", p.pid)
                p.kill()
                p.wait()
        self._watch_thread.join()  # every worker has exited: it returns at once
        self._heartbeats.close()

    def kill(self) -> None:
        """Ends the workers at once (the starter failed: no stop can reach them)."""
        self.kill_now()
        self.close(0.0)


def _start(module: str, args: WorkerArgs) -> subprocess.Popen[bytes]:
    """``python -P -m module`` (``-P``: the working directory is not on its import path) with
    ``args`` on its standard input; stdout and stderr are the starter's."""
    path = os.pathsep.join(p for p in (_SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)
    keep = (args.heartbeat_fd,) if args.heartbeat_fd >= 0 else ()
    proc = subprocess.Popen([sys.executable, "-P", "-m", module], stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": path}, pass_fds=keep)
    with contextlib.suppress(BrokenPipeError), proc.stdin:  # broken: it died at start, and
        pickle.dump(args, proc.stdin)  # the watch reports its exit code
    logger.info("tensor-parallel worker rank=%d pid=%d started", args.rank, proc.pid)
    return proc
