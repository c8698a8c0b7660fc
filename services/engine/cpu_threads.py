"""How many threads the engine's CPU math gets: every core this process may use, set once.

"May use" is the scheduler affinity (``taskset``, a Kubernetes static CPU policy, ``make serve``
giving each engine its own cores), further capped by a cgroup CPU quota (a container limited
to 2 CPUs on a 64-core node must not start 64 threads: they would time-slice the quota).
``os.cpu_count()`` knows neither.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_CGROUP_V2 = Path("/sys/fs/cgroup/cpu.max")
_CGROUP_V1 = (Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
              Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))


def usable_cpus() -> int:
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def _omp_num_threads() -> int | None:
    try:
        return int(os.environ["OMP_NUM_THREADS"]) or None
    except (KeyError, ValueError):
        return None


def _cgroup_quota() -> float | None:
    """CPUs the cgroup's quota allows (e.g. 2.5), or None without a quota."""
    try:
        if _CGROUP_V2.exists():
            quota, period = _CGROUP_V2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota_path, period_path = _CGROUP_V1
        if quota_path.exists():
            quota = int(quota_path.read_text())
            return None if quota <= 0 else quota / int(period_path.read_text())
    except (OSError, ValueError):
        return None
    return None


def configure(threads: int | None, ranks: int = 1) -> int:
    """Sets torch's intra-op threads (which the oneDNN GEMMs and the C++ kernels use) to
    ``threads``; by default ``$OMP_NUM_THREADS`` when set, else every usable core, shared out
    among the ``ranks`` model processes of a tensor-parallel engine (each gets its share, so
    they do not oversubscribe the cores). Returns the count."""
    n = threads or max(1, (_omp_num_threads() or usable_cpus()) // ranks)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    logger.info("CPU threads: %d (usable cores: %d)", n, usable_cpus())
    return n
