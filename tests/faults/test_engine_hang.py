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

from tests.faults.helpers import router_engines, wait_for
from tests.faults.load import LoadResult, run_load, word_prompt
from tests.support.stack import PagodaStack

STOP_AFTER_S = 2.0
LOAD_S = 12.0


def test_hung_engine_is_failed_over(fast_model_dir: Path) -> None:
    with PagodaStack(fast_model_dir, engines=2) as stack:
        router = stack.routers[0].url
        victim = stack.engine_id(0)
        wait_for(lambda: len(router_engines(router)) == 2, 10, "both engines")
        pid = stack.engines[0].proc.pid
        result = LoadResult()
        marks: dict[str, float] = {}

        async def hang_later() -> None:
            await asyncio.sleep(STOP_AFTER_S)
            marks["stop"] = time.monotonic()
            os.kill(pid, signal.SIGSTOP)

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 30),
                         duration_s=LOAD_S, concurrency=8, max_tokens=32, result=result,
                         request_timeout_s=60),
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
              f"slowest_request={slowest:.1f}s")
        failed = result.failed
        assert len(failed) <= in_flight, result.summary()
        assert all(o.error and o.error.startswith("stream error") for o in failed)
        # Nothing waited out the request timeout: heartbeat TTL (3 s) + probe (2 s) + slack.
        assert slowest < 9.0
        late = [o for o in result.outcomes if o.started > t + 8.0]
        assert late and all(o.ok for o in late)

        back = wait_for(lambda: victim in router_engines(router), 15, "engine back")
        again = asyncio.run(run_load(stack.base_url, stack.model,
                                     lambda i: word_prompt(20_000 + i, 30), requests=40,
                                     concurrency=8, max_tokens=8))
        print(f"after SIGCONT (routable again in {back:.2f}s): {again.summary()}")
        assert again.succeeded == again.sent and again.by_engine()[victim] >= 5
