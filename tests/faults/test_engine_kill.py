"""An engine SIGKILLed under load: only its in-flight streams fail; it leaves and comes back.

Real processes (redis-server, two engines, a router, the gateway); the client is a bounded
loop of streaming completions on loopback.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tests.faults.helpers import kv_blocks, router_engines, wait_for
from tests.faults.load import LoadResult, run_load, word_prompt
from tests.support.stack import PagodaStack, scrape

KILL_AFTER_S = 3.0
LOAD_S = 8.0


def test_engine_sigkill_mid_load(fast_model_dir: Path) -> None:
    with PagodaStack(fast_model_dir, engines=2) as stack:
        victim = stack.engine_id(0)
        router = stack.routers[0].url
        wait_for(lambda: router_engines(router) == {victim, stack.engine_id(1)}, 10,
                 "router sees both engines")
        result = LoadResult()
        killed_at: list[float] = []
        dropped_after: list[float] = []

        async def kill_later() -> None:
            await asyncio.sleep(KILL_AFTER_S)
            killed_at.append(time.monotonic())
            await asyncio.to_thread(stack.engines[0].kill)
            while victim in await asyncio.to_thread(router_engines, router):
                await asyncio.sleep(0.05)
            dropped_after.append(time.monotonic() - killed_at[0])

        async def scenario() -> None:
            await asyncio.gather(
                run_load(stack.base_url, stack.model, lambda i: word_prompt(i, 40),
                         duration_s=LOAD_S, concurrency=8, max_tokens=48, result=result),
                kill_later(),
            )

        asyncio.run(scenario())
        t_kill = killed_at[0]
        in_flight = result.in_flight_on(victim, t_kill)
        gone_after = dropped_after[0]
        retries = scrape(stack.gateway.url).get("pagoda_gateway_engine_retries_total", 0)
        failed = result.failed
        print(f"\nengine kill: {result.summary()} in_flight_on_victim_at_kill={in_flight} "
              f"gateway_retries={retries:.0f} heartbeat_gone_after={gone_after:.2f}s")

        assert result.sent > 50
        assert result.succeeded + len(failed) == result.sent
        # Requests not yet streaming were moved to the other engine; only streams in progress
        # on the victim may fail, each with an error event (not a hang or a broken stream).
        assert len(failed) <= in_flight, result.summary()
        assert all(o.engine == victim for o in failed), result.summary()
        assert all(o.error and o.error.startswith("stream error") for o in failed)
        # After the kill, new requests keep succeeding on the survivor.
        late = [o for o in result.outcomes if o.started > t_kill + 1.0]
        assert late and all(o.ok for o in late) and {o.engine for o in late} == {
            stack.engine_id(1)}
        # The router avoids the engine from its first failed request, so only requests routed
        # before that needed a retry; its heartbeat expires within the TTL (3 s here).
        assert retries <= 8, retries
        assert gone_after < 5.0

        # The engine comes back on its old address: the router sees it, and it gets traffic.
        stack.restart_engine(0)
        back_after = wait_for(lambda: victim in router_engines(router), 15,
                              "router sees the engine again")
        again = asyncio.run(run_load(stack.base_url, stack.model,
                                     lambda i: word_prompt(10_000 + i, 40), requests=40,
                                     concurrency=8, max_tokens=8))
        print(f"after restart (seen by the router in {back_after:.2f}s): {again.summary()}")
        assert again.succeeded == again.sent
        assert again.by_engine()[victim] >= 5, again.summary()
        for engine in stack.engines:
            wait_for(lambda e=engine: kv_blocks(e.url)[0] == kv_blocks(e.url)[1], 10,
                     "every KV block free again")
