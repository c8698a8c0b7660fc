"""The life of a tensor-parallel worker process (ranks 1..N-1), around its model.

``workers.WorkerGroup`` starts each worker as ``python -m <entry module>``: a fresh interpreter
that imports the entry module and what it needs, never the user's script (so a script read from
standard input, or one without a ``__main__`` guard, starts workers like any other). The entry
calls ``run_worker`` with a ``build`` function; ``run_worker`` reads the ``WorkerArgs`` rank 0
wrote (pickled) to its standard input, arms the death signal, joins the group, builds the
rank's step function with ``build`` and runs each step rank 0 sends until told to stop.

A worker never outlives its engine: it dies with the thread that started it
(``PR_SET_PDEATHSIG``), and one whose engine died before that was armed (its parent is no
longer the engine) exits at once. Any failure exits with ``EXIT_CODE`` after logging it, which
rank 0's watchdog turns into the engine's exit.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.child_process import die_with_parent
from services.common.logs import setup_logging
from services.engine.parallel import group as tp_group
from services.engine.parallel.group import TPGroup
from services.engine.parallel.step_broadcast import StepBatch, receive_step

logger = logging.getLogger(__name__)

EXIT_CODE = 1  # a worker that fails, or whose engine is gone

# A rank's step: runs the model over the batch (its results stay on rank 0).
StepFn = Callable[[StepBatch], object]


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What rank 0 hands a worker on its standard input."""

    rank: int
    size: int
    port: int  # rank 0's rendezvous store
    parent_pid: int  # the engine process
    device: str  # this rank's device
    log_level: int
    payload: Any  # what the entry module's ``build`` needs (the engine's config, model path)


def run_worker(build: Callable[[WorkerArgs, TPGroup], StepFn]) -> None:
    """A worker process from start to stop; returns only after a clean stop."""
    die_with_parent()
    args = _read_args()
    setup_logging(args.log_level, f"engine-tp{args.rank}")
    if os.getppid() != args.parent_pid:  # the engine died before the death signal was armed
        os._exit(EXIT_CODE)
    try:
        store = tp_group.connect_store(args.port, args.size)
        device = torch.device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tp = tp_group.join(args.rank, args.size, store, device)
        step = build(args, tp)
        while (batch := receive_step(tp)) is not None:
            step(batch)
        tp_group.leave()
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", args.rank)
        logging.shutdown()
        os._exit(EXIT_CODE)


def _read_args() -> WorkerArgs:
    try:
        args = pickle.load(sys.stdin.buffer)
    except (EOFError, pickle.UnpicklingError):  # the engine died before it wrote them
        os._exit(EXIT_CODE)
    sys.stdin.close()
    assert isinstance(args, WorkerArgs), type(args)
    return args
