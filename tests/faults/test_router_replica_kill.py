"""A router replica SIGKILLed with two running: no request fails.

The gateway is given both replicas (``--router-url A,B``); a replica that fails is skipped and
the same request asks the other one, so the client never sees the loss.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.faults.load import LoadResult, run_load, word_prompt
from tests.support.stack import PagodaStack, scrape


def test_router_replica_sigkill_mid_load(fast_model_dir: Path) -> None:
    with PagodaStack(fast_model_dir, engines=1, routers=2) as stack:
        result = LoadResult()

        async def kill_later() -> None:
            await asyncio.sleep(2.0)
            await asyncio.to_thread(stack.routers[0].kill)

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 30),
                         duration_s=6.0, concurrency=8, max_tokens=16, result=result),
                kill_later(),
            )

        asyncio.run(scenario())
        routed = [scrape(r.url).get("pagoda_router_decisions_total", 0.0)
                  for r in stack.routers[1:]]
        print(f"\nrouter replica kill: {result.summary()} survivor_decisions={routed}")
        assert result.sent > 30
        assert not result.failed, result.summary()
        assert routed[0] > result.sent / 3  # the survivor took over
        assert "trying the next replica" in stack.gateway.log_text()
