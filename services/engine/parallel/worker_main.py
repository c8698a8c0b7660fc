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
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from services.common.child_process import die_with_parent
from services.common.logs import setup_logging
from services.engine.parallel import group as tp_group
from services.engine.parallel import node_join
from services.engine.parallel.group import TPGroup
from services.engine.parallel.node_group import NodeGroup
from services.engine.parallel.node_links import NodeLinks
from services.engine.parallel.step_broadcast import StepBatch, receive_step

logger = logging.getLogger(__name__)

EXIT_CODE = 1  # a worker that fails, or whose engine is gone



class RankLoop(ABC):
    """What ``build`` returns for a rank whose steps do not come by the step broadcast (a
    pipeline stage's come from the stage before it): ``run`` receives and runs them until its
    own stop comes; the broadcast's stop then ends the rank as any other."""

    @abstractmethod
    def run(self) -> None: ...

    def __call__(self, batch: StepBatch) -> None:
        raise AssertionError("a pipeline rank receives no broadcast step")


# A rank's step: runs the model over the batch (its results stay on rank 0).
StepFn = Callable[[StepBatch], object] | RankLoop


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
        _serve(args, tp_group.connect_store(args.port, args.size), build)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"tensor-parallel worker rank {args.rank} failed")


def run_node_worker(args: WorkerArgs, nodes: NodeGroup, identity: node_join.Identity,
                    build: Callable[[WorkerArgs, TPGroup], StepFn],
                    on_ready: Callable[[], None]) -> None:
    """A worker node's rank (a pod of its own, ``node_group``): admitted by the leader
    (``node_join``), watched over its heartbeat link (``node_links``) and then as a local
    worker; returns only after a clean stop. A refusal, a lost leader or any failure exits
    the process with ``EXIT_CODE``, the reason logged."""
    try:
        admission = node_join.request_admission(nodes, identity,
                                                tp_group.COLLECTIVE_TIMEOUT.total_seconds())
    except node_join.JoinRefused as exc:
        _fail(str(exc), trace=False)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"worker node rank {nodes.node_rank} could not join its leader")
    links = NodeLinks({"the leader": admission.link},
                      lambda why: _fail(f"worker node rank {nodes.node_rank}: {why}",
                                        trace=False)).start()
    try:
        store = tp_group.connect_store(admission.store_port, args.size, nodes.master_addr)
        _serve(args, dist.PrefixStore(admission.prefix, store), build,
               loopback=nodes.is_loopback(), on_ready=on_ready)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"worker node rank {nodes.node_rank} failed")
    links.close()


def _serve(args: WorkerArgs, store: dist.Store, build: Callable[[WorkerArgs, TPGroup], StepFn],
           loopback: bool = True, on_ready: Callable[[], None] | None = None) -> None:
    """Joins the group, builds the rank's step and runs every step until told to stop."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = tp_group.join(args.rank, args.size, store, device, loopback)
    step = build(args, tp)
    if on_ready is not None:
        on_ready()
    if isinstance(step, RankLoop):
        step.run()
    while (batch := receive_step(tp)) is not None:
        step(batch)
    tp_group.leave()


def _fail(message: str, trace: bool = True) -> NoReturn:
    """Logs ``message`` (with the exception being handled, if ``trace``) and exits at once."""
    if trace:
        logger.exception("%s", message)
    else:
        logger.error("%s", message)
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
