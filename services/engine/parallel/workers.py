"""The other ranks of a tensor-parallel engine as rank 0 sees them: started or admitted, watched
until it ends.

Rank 0 (the engine process) starts the ranks of its own pod (1..N-1 in one pod; 1..R-1 of R per
pod in a node group) as ``local_workers``, each ``python -m <entry module>`` (``worker_main``).
This package knows the entry only by name: the engine that uses it names its own.

Failure is never a hang:

* a worker that exits while the engine runs: a watchdog thread in the engine sees it (the
  process's pidfd), logs which rank and its exit code, kills the other workers and exits the
  engine process with status 1, at once, whatever rank 0 was doing (blocked in a collective
  with the dead rank, on NCCL, it would otherwise wait forever). The pod restarts.
* a worker that hangs (SIGSTOP, stuck): its heartbeat link to rank 0 (``heartbeat``, a byte
  every 0.5 s from a thread of its own) goes silent, and 2.5 s of silence is handled as its
  exit, long before the step watchdog (``--step-timeout-s``) would notice.
* the engine process dying: the kernel kills every worker (``PR_SET_PDEATHSIG``, bound to the
  thread that started them: the engine's own thread), and any collective in progress on gloo
  fails at once.
* an error on rank 0 in the middle of a step (the ranks are then out of step): ``abort``.
* with ranks in other pods (a node group, ``node_group``): rank 0 admits each worker pod at
  its door (``node_join``), and a worker pod that dies or hangs is seen on its heartbeat link
  (``heartbeat``) within seconds, which ``abort`` too. A worker pod's own local workers are
  its process's to watch: one that dies ends that process, which its link then reports.

Lifecycle: ``close`` (a stop message, a grace period, then a kill) ends the workers and leaves
the process group, so that the process can start another tensor-parallel engine after it; it
is idempotent and also runs at interpreter exit, so that a normal exit is never read as the
workers' failure.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch

from services.engine.parallel import group as tp_group
from services.engine.parallel import node_join
from services.engine.parallel.group import Rendezvous
from services.engine.parallel.heartbeat import Heartbeats
from services.engine.parallel.local_workers import STOP_GRACE_S, LocalWorkers, rank_device
from services.engine.parallel.node_group import NodeGroup
from services.engine.parallel.step_broadcast import send_stop
from services.engine.parallel.worker_main import EXIT_CODE

logger = logging.getLogger(__name__)


class WorkerGroup:
    """Ranks 1..N-1 of an engine, as seen from rank 0; ``tp`` is rank 0's group and ``device``
    its device.

    ``module``: the workers' entry (run as ``python -m module``; it calls
    ``worker_main.run_worker``); ``payload``: what that entry needs to build a rank's shard,
    the same for every rank (each learns its own rank and device from its ``WorkerArgs``).

    ``nodes``: the node group when the ranks span pods (this pod starts its own
    ``nodes.ranks_per_node - 1`` local workers and admits the other pods); ``identity``: what
    every worker pod must match to be admitted."""

    def __init__(self, module: str, size: int, device: torch.device, payload: object,
                 nodes: NodeGroup | None = None,
                 identity: node_join.Identity | None = None) -> None:
        remote = nodes is not None and nodes.nnodes > 1
        per_pod = nodes.ranks_per_node if remote else size
        assert not remote or size == nodes.nnodes * per_pod, "EngineConfig checks the layout"
        tp_group.check_free()  # before any worker starts
        self.device = rank_device(device, 0)
        self._closing = False
        self._links: Heartbeats | None = None
        self._local: LocalWorkers | None = None
        self._store = tp_group.create_store(size)  # the rendezvous: kept for the group's life
        # Across pods the store is reached only under a secret prefix (``node_join``).
        rendezvous = Rendezvous(self._store.port, prefix=node_join.new_prefix() if remote
                                else "", loopback=not remote or nodes.is_loopback())
        try:
            self._local = LocalWorkers(module, 0, per_pod, size, device, rendezvous, payload,
                                       self.abort)
            if remote:
                self._admit(nodes, identity or {}, rendezvous.prefix)
            atexit.register(self.close)
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.tp = tp_group.join(0, size, rendezvous.wrap(self._store), self.device,
                                    rendezvous.loopback)
        except BaseException:
            self.kill()
            raise

    def _admit(self, nodes: NodeGroup, identity: node_join.Identity, prefix: str) -> None:
        """Rank 0 of a node group: admits every worker pod, watches them from then on."""
        logger.info("waiting for %d worker node(s) at %s:%d", nodes.nnodes - 1,
                    nodes.master_addr, nodes.master_port)
        links = node_join.Door(nodes).admit(identity, self._store.port, prefix,
                                            tp_group.COLLECTIVE_TIMEOUT.total_seconds())
        self._links = Heartbeats({f"worker node rank {r}": c for r, c in links.items()},
                                 self.abort).start()

    @property
    def pids(self) -> list[int]:
        """This pod's workers (a node group's other pods are not this process's)."""
        return [] if self._local is None else self._local.pids

    def abort(self, reason: str) -> None:
        """The engine cannot go on with a rank missing or out of step: end it now, non-zero."""
        logger.critical("%s; the engine exits (status %d)", reason, EXIT_CODE)
        if self._local is not None:
            self._local.kill_now()
        logging.shutdown()
        os._exit(EXIT_CODE)

    def close(self) -> None:
        """Stops the workers (told, then killed after a grace period) and leaves the group."""
        if self._closing:
            return
        self._closing = True
        assert self._local is not None  # close is registered once the group stands
        self._local.stopping()
        try:
            if self._local.all_alive():
                send_stop(self.tp)
        except RuntimeError:  # a worker died meanwhile: nothing left to tell
            logger.warning("could not tell the tensor-parallel workers to stop")
        if self._links is not None:
            self._links.close()
        self._local.close(STOP_GRACE_S)
        self._end()

    def kill(self) -> None:
        """Ends the workers at once (rank 0 failed to start: no stop message can reach them)."""
        self._closing = True
        if self._links is not None:
            self._links.close()
        if self._local is not None:
            self._local.kill()
        self._end()

    def _end(self) -> None:
        tp_group.leave()
        atexit.unregister(self.close)
