"""The life of a tensor-parallel worker process (ranks 1..N-1), around its model.

``local_workers.LocalWorkers`` starts each worker as ``python -m <entry module>`` (rank 0's
``workers.WorkerGroup`` in one pod; in a node group each pod's own process, ``run_node_worker``,
starts the other ranks of its pod): a fresh interpreter that imports the entry module and what
it needs, never the user's script (so a script read from standard input, or one without a
``__main__`` guard, starts workers like any other). The entry calls ``run_worker`` with a
``build`` function; ``run_worker`` reads the ``WorkerArgs`` its starter wrote (pickled) to its
standard input, arms the death signal, pings its starter over its heartbeat link
(``heartbeat``: a hung worker is told from a busy one), joins the group at its
``Rendezvous``, builds the rank's step function with ``build`` and runs each step rank 0 sends
until told to stop.

A worker never outlives its starter: it dies with the thread that started it
(``PR_SET_PDEATHSIG``), and one whose starter died before that was armed (its parent is no
longer the starter) exits at once. Any failure exits with ``EXIT_CODE`` after logging it, which
the starter's watch turns into its own exit (the engine's, or the worker pod's and so, over its
heartbeat link, the leader's).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import NoReturn

import torch

from services.common.child_process import die_with_parent
from services.common.logs import setup_logging
from services.engine.parallel import group as tp_group
from services.engine.parallel import node_join
from services.engine.parallel.group import Rendezvous, TPGroup
from services.engine.parallel.heartbeat import Heartbeats
from services.engine.parallel.local_workers import LocalWorkers, WorkerArgs
from services.engine.parallel.node_group import NodeGroup
from services.engine.parallel.step_broadcast import StepBatch, receive_step

logger = logging.getLogger(__name__)

EXIT_CODE = 1  # a worker that fails, or whose engine is gone

__all__ = ["EXIT_CODE", "RankLoop", "StepFn", "WorkerArgs", "run_node_worker", "run_worker"]


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


def run_worker(build: Callable[[WorkerArgs, TPGroup], StepFn]) -> None:
    """A worker process from start to stop; returns only after a clean stop."""
    die_with_parent()
    args = _read_args()
    setup_logging(args.log_level, f"engine-tp{args.rank}")
    if os.getppid() != args.parent_pid:  # the engine died before the death signal was armed
        os._exit(EXIT_CODE)
    heartbeats = _ping_starter(args)
    try:
        _serve(args, build)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"tensor-parallel worker rank {args.rank} failed")
    if heartbeats is not None:
        heartbeats.close()  # a goodbye: the exit that follows is no failure


def _ping_starter(args: WorkerArgs) -> Heartbeats | None:
    """Pings the starter over the worker's heartbeat link from a thread of its own, so that
    the starter tells a hung worker (silent) from a busy one (its step releases the GIL). Its
    starter's silence is not this side's to judge (the starter's own watch does, or it is the
    engine); its link closing is the starter's death."""
    if args.heartbeat_fd < 0:
        return None
    link = socket.socket(fileno=args.heartbeat_fd)
    return Heartbeats({f"its starter (pid {args.parent_pid})": link},
                      lambda why: _fail(f"tensor-parallel worker rank {args.rank}: {why}",
                                        trace=False),
                      watch_silence=False).start()


def run_node_worker(args: WorkerArgs, nodes: NodeGroup, identity: node_join.Identity,
                    module: str, build: Callable[[WorkerArgs, TPGroup], StepFn],
                    on_ready: Callable[[], None]) -> None:
    """A worker pod's own process (rank ``nodes.first_rank``, ``node_group``): admitted by the
    leader (``node_join``), watched over its heartbeat link (``heartbeat``), it starts the
    pod's other ranks (``module``, as rank 0 starts a single pod's) and runs its own; returns
    only after a clean stop. A refusal, a lost leader, a local worker's death or any failure
    exits the process with ``EXIT_CODE``, the reason logged: its closed link then ends the
    leader, and its local workers die with it."""
    assert args.rank == nodes.first_rank, (args.rank, nodes)
    where = f"worker node rank {nodes.node_rank}"
    try:
        admission = node_join.request_admission(nodes, identity,
                                                tp_group.COLLECTIVE_TIMEOUT.total_seconds())
    except node_join.JoinRefused as exc:
        _fail(str(exc), trace=False)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"{where} could not join its leader")
    links = Heartbeats({"the leader": admission.link},
                       lambda why: _fail(f"{where}: {why}", trace=False)).start()
    args = replace(args, rendezvous=Rendezvous(admission.store_port, nodes.master_addr,
                                               admission.prefix, nodes.is_loopback()))
    try:
        local = LocalWorkers(module, args.rank, nodes.ranks_per_node, args.size,
                             torch.device(args.device), args.rendezvous, args.payload,
                             lambda why: _fail(f"{where}: {why}", trace=False))
        _serve(args, build, on_ready=on_ready)
    except BaseException:  # noqa: BLE001 -- _fail logs it, then exits
        _fail(f"{where} failed")
    local.close()  # they read the same stop
    links.close()


def _serve(args: WorkerArgs, build: Callable[[WorkerArgs, TPGroup], StepFn],
           on_ready: Callable[[], None] | None = None) -> None:
    """Joins the group, builds the rank's step and runs every step until told to stop."""
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = args.rendezvous.connect(args.size)
    tp = tp_group.join(args.rank, args.size, store, device, args.rendezvous.loopback)
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
