"""The ranks a process starts on its own host (``parallel.local_workers``), without a model: a
worker that fails is reported once with its rank and exit code; one that exits 0 (it stopped as
the group's stop told it, which a worker pod reads in the same broadcast as its local ranks) is
not a failure."""

from __future__ import annotations

import os
import signal
import threading
import time

import torch

from services.engine.parallel.group import Rendezvous
from services.engine.parallel.heartbeat import SILENCE_S
from services.engine.parallel.local_workers import LocalWorkers

MODULE = "tests.support.exiting_worker"


def _start(code: int | str, first_rank: int = 2) -> tuple[LocalWorkers, list[str], threading.Event]:
    reported: list[str] = []
    done = threading.Event()

    def on_exit(why: str) -> None:
        reported.append(why)
        done.set()

    local = LocalWorkers(MODULE, first_rank, 2, 4, torch.device("cpu"), Rendezvous(1), code,
                         on_exit)
    return local, reported, done


def test_a_failed_local_rank_is_reported_with_its_global_rank() -> None:
    local, reported, done = _start(3)
    assert done.wait(30)
    local.close(5.0)
    (why,) = reported
    assert "worker rank 3 " in why and "exited with code 3" in why, why


def test_a_local_rank_that_stopped_cleanly_is_no_failure() -> None:
    local, reported, _ = _start(0)
    (proc,) = local.procs
    proc.wait(30)
    local._watch_thread.join(10)  # the watch saw the exit before any close: its only worker
    assert not local._watch_thread.is_alive() and reported == []
    local.close(5.0)


def test_a_hung_local_rank_is_reported_within_seconds() -> None:
    """A stopped rank (SIGSTOP) never exits: its silent heartbeat link tells it; while it runs
    (pinging from its own thread) nothing is reported."""
    local, reported, done = _start("ping")  # type: ignore[arg-type]
    (proc,) = local.procs
    try:
        assert not done.wait(SILENCE_S + 2), reported  # running: pings, starts and all
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        assert done.wait(SILENCE_S + 3)
        took = time.monotonic() - stopped
        print(f"\nhung local rank reported {took:.2f}s after SIGSTOP")
        (why,) = reported
        assert "worker rank 3 (pid" in why and "went silent" in why, why
        assert SILENCE_S - 0.6 <= took < SILENCE_S + 1.5, took
    finally:
        local.kill()
