"""The step-progress watchdog (``--step-timeout-s``): a core that stops stepping while requests
wait on it is failed as a dead one.

A core that dies says so (its thread's handler, its process's closed pipe); one that hangs (a
read that never returns, a stuck kernel, a deadlock) says nothing: its requests would wait out
their timeouts while /health stayed 200 and the router kept choosing it. A stepping core sends
a batch every step, so the event loop watches for batches: when requests have waited longer
than the timeout without one, ``CoreClient.fail`` fails them, turns /health 503 and tells the
server (which leaves the routing set and exits: the pod restarts). An idle core owes nothing:
the clock starts when a request arrives at an idle core (``CoreClient.stalled_for``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from services.engine.serving.core_client import CoreClient

logger = logging.getLogger(__name__)

_MAX_PERIOD_S = 1.0  # how often it looks, at most: a stall is seen within this of the timeout


async def watch(core: CoreClient, timeout_s: float) -> None:
    """Runs until the core has failed (here or elsewhere); cancel it to stop it sooner."""
    assert timeout_s > 0, timeout_s
    period = min(_MAX_PERIOD_S, timeout_s / 4)
    while not core.died:
        await asyncio.sleep(period)
        stalled = core.stalled_for(time.monotonic())
        if stalled > timeout_s and not core.died:
            logger.error("engine core stalled: no step finished for %.1f s with %d requests "
                         "waiting (--step-timeout-s %g); failing them and leaving",
                         stalled, core.num_in_flight, timeout_s)
            core.fail(f"engine core stalled: no step finished for {stalled:.0f} s")
