"""The ranks a process starts on its own host (``parallel.local_workers``), without a model: a
worker that fails is reported once with its rank and exit code; one that exits 0 (it stopped as
the group's stop told it, which a worker pod reads in the same broadcast as its local ranks) is
not a failure."""

from __future__ import annotations

import threading

import torch

from services.engine.parallel.group import Rendezvous
from services.engine.parallel.local_workers import LocalWorkers

MODULE = "tests.support.exiting_worker"


def _start(code: int, first_rank: int = 2) -> tuple[LocalWorkers, list[str], threading.Event]:
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
