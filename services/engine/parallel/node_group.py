"""Where an engine's ranks live when they span pods: the node group, and how a pod learns it.

One engine may run its ranks in several pods (nodes) started on their own, as a LeaderWorkerSet
starts one pod per group member: node 0 (the leader) serves HTTP, schedules and samples; nodes
1..N-1 (workers) join its tensor-parallel group and run their shard of every step. A pod learns
its place from vLLM's flags (``--nnodes``, ``--node-rank``, ``--master-addr``,
``--master-port``) or, in a LeaderWorkerSet, from the environment the LWS controller sets on
every pod of a group (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``, the
leader's index being 0). Flags given win over the environment.

A pod holds ``ranks_per_node`` consecutive ranks: node r holds ranks ``r*R .. r*R+R-1``, the
first being the pod's own process, the others local workers it starts as a single-pod
tensor-parallel engine does (``local_workers``). Either each pod holds one rank (any
``pipeline_parallel_size x tensor_parallel_size`` equal to the group size), or each holds one
pipeline stage of ``tensor_parallel_size`` ranks (``pipeline_parallel_size`` equal to the group
size). With ``pipeline``'s layout (ranks ``0..T-1`` the last stage, ``T..2T-1`` stage 0, ...)
the leader's pod is then the last stage, node 1 stage 0, node 2 stage 1, and so on::

    pods  (N = P = 2, T = 2)   node 0 (leader)      node 1
    ranks                      0, 1                 2, 3
    stage                      1 (last: samples)    0
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass

LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
LWS_GROUP_SIZE = "LWS_GROUP_SIZE"
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """This pod's place in its engine's node group."""

    nnodes: int
    node_rank: int
    master_addr: str  # the leader's address (its rendezvous listens there)
    master_port: int  # the leader's rendezvous port
    ranks_per_node: int = 1  # model ranks in each pod (the pod's process and its local workers)

    def __post_init__(self) -> None:
        assert self.ranks_per_node >= 1, self

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    @property
    def first_rank(self) -> int:
        """The global rank of this pod's own process (its local workers follow it)."""
        return self.node_rank * self.ranks_per_node

    def is_loopback(self) -> bool:
        """Every node on this host (tests, a laptop): the group talks over ``lo``."""
        try:
            return ipaddress.ip_address(socket.gethostbyname(self.master_addr)).is_loopback
        except (OSError, ValueError):
            return False


def from_lws_env(env: Mapping[str, str]) -> dict[str, object]:
    """The node fields (``nnodes``, ``node_rank``, ``master_addr``) an LWS pod's environment
    sets; {} outside a LeaderWorkerSet. A variable that is set but malformed is a
    ``ValueError`` naming it (the pod must not start as a lone engine by mistake)."""
    if LWS_GROUP_SIZE not in env:
        return {}
    fields: dict[str, object] = {}
    for var, name in ((LWS_GROUP_SIZE, "nnodes"), (LWS_WORKER_INDEX, "node_rank")):
        raw = env.get(var, "")
        if not raw.isdigit():
            raise ValueError(f"{var} must be a non-negative integer, got {raw!r}")
        fields[name] = int(raw)
    leader = env.get(LWS_LEADER_ADDRESS, "").strip()
    if not leader:
        raise ValueError(f"{LWS_GROUP_SIZE} is set but {LWS_LEADER_ADDRESS} is empty")
    fields["master_addr"] = leader
    return fields
