"""An engine that hangs (SIGSTOP: its sockets stay open, nothing answers) under load.

A crash resets connections; a hang does not, so without help a request waiting on the hung
engine would wait out the whole request timeout. The gateway probes an engine it waits on
once the engine's heartbeat expires; one that does not answer /health is declared dead:
requests still waiting for their first token are retried elsewhere and succeed, streams in
progress end with an error event. SIGCONT brings the engine back into rotation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from tests.faults.helpers import router_engine_idle, router_engines, wait_for
from tests.faults.load import LoadResult, run_load, word_prompt
from tests.support.stack import PagodaStack

STOP_AFTER = 40  # requests sent before the engine hangs
LATE = 16  # requests after the hang was noticed, all served by the other engine
LOAD_CAP_S = 60.0


def test_hung_engine_is_failed_over(fast_model_dir: Path) -> None:
    with PagodaStack(fast_model_dir, engines=2) as stack:
        router = stack.routers[0].url
        victim = stack.engine_id(0)
        wait_for(lambda: len(router_engines(router)) == 2, 10, "both engines")
        pid = stack.engines[0].proc.pid
        result = LoadResult()
        marks: dict[str, float] = {}

        async def hang_later() -> None:
            while result.sent < STOP_AFTER:
                await asyncio.sleep(0.01)
            marks["stop"] = time.monotonic()
            os.kill(pid, signal.SIGSTOP)
            while victim in await asyncio.to_thread(router_engines, router):
                await asyncio.sleep(0.05)
            marks["gone"] = time.monotonic()  # its heartbeat expired: no new request goes there

        def failed_over() -> bool:
            """Every request sent before the heartbeat expired has ended (served, failed over,
            or its stream cut), and LATE requests after it were served."""
            gone = marks.get("gone")
            if gone is None:
                return False
            early = [o for o in result.outcomes if o.started < gone]
            late = [o for o in result.outcomes if o.started >= gone and o.ended]
            return all(o.ended for o in early) and len(late) >= LATE

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 30),
                         duration_s=LOAD_CAP_S, until=failed_over, concurrency=8,
                         max_tokens=32, result=result, request_timeout_s=60),
                hang_later(),
            )

        try:
            asyncio.run(scenario())
        finally:
            os.kill(pid, signal.SIGCONT)
        t = marks["stop"]
        in_flight = result.in_flight_on(victim, t)
        slowest = max(o.ended - o.started for o in result.outcomes)
        print(f"\nengine hang: {result.summary()} streaming_on_victim_at_stop={in_flight} "
              f"heartbeat_gone_after={marks['gone'] - t:.1f}s slowest_request={slowest:.1f}s")
        assert failed_over(), result.summary()
        failed = result.failed
        assert len(failed) <= in_flight, result.summary()
        assert all(o.error and o.error.startswith("stream error") for o in failed)
        # Nothing waited out the request timeout: heartbeat TTL (3 s) + probe (2 s) + slack.
        assert slowest < 9.0
        late = [o for o in result.outcomes if o.started >= marks["gone"]]
        assert all(o.ok and o.engine == stack.engine_id(1) for o in late), result.summary()

        # The engine resumes moments after the gateway failed requests over from it (the
        # router was told to avoid it): its first heartbeat puts it back in rotation, and with
        # two idle engines it gets about half of the next requests (once its heartbeat no
        # longer counts the requests it held when it stopped: the router weighs load).
        back = wait_for(lambda: victim in router_engines(router), 15, "engine back")
        wait_for(lambda: router_engine_idle(router, victim), 15, "engine idle")
        again = asyncio.run(run_load(stack.base_url, stack.model,
                                     lambda i: word_prompt(20_000 + i, 30), requests=40,
                                     concurrency=8, max_tokens=8))
        print(f"after SIGCONT (routable again in {back:.2f}s): {again.summary()}")
        assert again.succeeded == again.sent and again.by_engine()[victim] >= 10, again.summary()
