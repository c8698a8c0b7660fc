"""The worker processes of a tensor-parallel engine: started by rank 0, watched until it ends.

Rank 0 (the engine process) spawns ranks 1..N-1, each a fresh interpreter (``spawn``: never a
fork of a process that holds threads or a CUDA context). A worker loads its shard with the same
``ModelRunner`` as rank 0, then runs each step it is sent until told to stop.

Failure is never a hang:

* a worker that exits while the engine runs: a watchdog thread in the engine sees it (the
  process sentinel), logs which rank and its exit code, kills the other workers and exits the
  engine process with status 1, at once, whatever rank 0 was doing (blocked in a collective
  with the dead rank, on NCCL, it would otherwise wait forever). The pod restarts.
* the engine process dying: the kernel kills every worker (``PR_SET_PDEATHSIG``, bound to the
  thread that started them: the engine's own thread), and any collective in progress on gloo
  fails at once.
* an error on rank 0 in the middle of a step (the ranks are then out of step): ``abort``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from dataclasses import replace

import torch

from services.engine.config import EngineConfig
from services.engine.parallel import group as tp_group
from services.engine.parallel.step_broadcast import send_stop
from services.engine.parallel.worker_main import EXIT_CODE, WorkerArgs, worker_main

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 10.0


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs with: its own GPU (``cuda:<base + rank>``)."""
    device = config.torch_device()
    if device.type != "cuda":
        return replace(config, device="cpu")
    return replace(config, device=f"cuda:{(device.index or 0) + rank}")


def check_devices(config: EngineConfig) -> None:
    """More ranks than GPUs is an error at start, naming both numbers."""
    size, device = config.tensor_parallel_size, config.torch_device()
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
    """Ranks 1..N-1 of an engine, as seen from rank 0; ``tp`` is rank 0's group."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        size = config.tensor_parallel_size
        check_devices(config)
        self._closing = threading.Event()
        store = tp_group.create_store(size)
        ctx = multiprocessing.get_context("spawn")
        self.procs = [
            ctx.Process(
                target=worker_main,
                args=(WorkerArgs(rank, size, store.port, rank_config(config, rank), model_path,
                                  logging.getLogger().getEffectiveLevel()),),
                name=f"pagoda-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for p in self.procs:
            p.start()
            logger.info("tensor-parallel worker rank=%s pid=%d started", p.name, p.pid)
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()
        # Before multiprocessing's own exit handler (atexit runs last-registered first), so
        # that a normal exit stops the workers instead of reading as their failure.
        atexit.register(self.close)
        device = rank_config(config, 0).torch_device()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.tp = tp_group.join(0, size, store, device)
        self._store = store  # the workers' rendezvous: kept for the group's lifetime

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch(self) -> None:
        by_sentinel = {p.sentinel: p for p in self.procs}
        ended = multiprocessing.connection.wait(list(by_sentinel))
        if self._closing.is_set():
            return
        proc = by_sentinel[ended[0]]
        proc.join(1.0)  # the sentinel closes a moment before the exit status is there
        self.abort(f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code "
                   f"{proc.exitcode}")

    def abort(self, reason: str) -> None:
        """The engine cannot go on with a rank missing or out of step: end it now, non-zero."""
        logger.critical("%s; the engine exits (status %d)", reason, EXIT_CODE)
        for p in self.procs:
            if p.is_alive():
                p.kill()
        logging.shutdown()
        os._exit(EXIT_CODE)

    def close(self) -> None:
        """Stops the workers (told, then killed after a grace period) and leaves the group."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            if all(p.is_alive() for p in self.procs):
                send_stop(self.tp)
        except RuntimeError:  # a worker died meanwhile: nothing left to tell
            logger.warning("could not tell the tensor-parallel workers to stop")
        deadline = time.monotonic() + _STOP_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        tp_group.leave()
        atexit.unregister(self.close)

    def kill(self) -> None:
        """Ends the workers at once (rank 0 failed to start: no stop message can reach them)."""
        self._closing.set()
        for p in self.procs:
            p.kill()
            p.join()
        tp_group.leave()
        atexit.unregister(self.close)
